"""The n8n workflows shipped in examples/platforms/n8n, checked offline (CI has no n8n; the real runs are
tests/test_n8n_real.py, test_n8n_events_real.py and test_n8n_pull_template_real.py): every node an
expression or a connection names exists, every node is reachable from a trigger, and the pull loop
commits with lease_next and works on the batch whichever request leased it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

N8N = Path(__file__).resolve().parents[1] / "examples" / "platforms" / "n8n"
WORKFLOWS = sorted(p.name for p in N8N.glob("*.json"))
NAMED = re.compile(r"""\$\(\s*'([^']+)'\s*\)|\$node\[\s*['"]([^'"]+)['"]\s*\]""")


def load(name: str) -> dict:
    return json.loads((N8N / name).read_text())


@pytest.mark.parametrize("name", WORKFLOWS)
def test_every_named_node_exists_and_every_node_is_reached(name):
    got = load(name)
    for workflow in got if isinstance(got, list) else [got]:  # some files hold an array (n8n 1.x's import)
        check_graph(workflow)


def check_graph(workflow: dict) -> None:
    nodes = {n["name"]: n for n in workflow["nodes"]}
    assert len(nodes) == len(workflow["nodes"]), "two nodes share a name"
    for node in workflow["nodes"]:
        for a, b in NAMED.findall(json.dumps(node["parameters"])):
            assert (a or b) in nodes, f"{node['name']} names a node that is not there: {a or b}"
    edges: dict[str, set[str]] = {}
    for source, outputs in workflow["connections"].items():
        assert source in nodes, source
        for output in outputs["main"]:
            for link in output:
                assert link["node"] in nodes, link
                edges.setdefault(source, set()).add(link["node"])
    reached = {n for n, node in nodes.items()
               if "trigger" in node["type"].lower() or "webhook" in node["type"].lower()}
    todo = list(reached)
    while todo:
        for nxt in edges.get(todo.pop(), ()):
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    assert reached == set(nodes), f"never reached: {set(nodes) - reached}"


def test_the_pull_loop_commits_with_lease_next_and_reads_its_batch_from_one_node():
    workflow = load("pull-loop.json")
    nodes = {n["name"]: n for n in workflow["nodes"]}
    complete = nodes["Complete"]["parameters"]["jsonBody"]
    assert "lease_next:" in complete and "max_batches" in complete  # the run's last step asks for none
    for name in ("Process batch (replace me)", "Complete", "Fail"):
        text = json.dumps(nodes[name]["parameters"])
        assert "$('Batch')" in text and "$('Lease')" not in text, name
    into_batch = {src for src, out in workflow["connections"].items()
                  for links in out["main"] for link in links if link["node"] == "Batch"}
    assert into_batch == {"Leased?", "Next leased?"}
