"""The Dify pull-mode template (examples/platforms/dify/pull-loop.yml), checked as far as it can be offline.

No Dify runs here, so the DSL is checked against what Dify's importer and node schemas require, copied
below from Dify's source with where they come from, and then *run*: a small interpreter executes the
graph the way Dify's engine walks it (HTTP Request nodes render their url/headers/body templates from
the variable pool and send them over a real socket to a real batchgate API; Code nodes run their Python
``main``; If/Else picks a case; a fail-branch node's error takes its ``fail-branch`` edge), so the
requests the template makes are proven against batchgate itself, not against a copy of its contract.

Sources (langgenius/graphon is the package Dify's api/ imports its workflow nodes from):
- import: langgenius/dify api/services/app_dsl_service.py and api/services/dsl_version.py at 0013bcd9 and
  c714a8e3; current DSL version 0.6.0 (api/constants/dsl_version.py at 0d163527).
- node data: langgenius/graphon src/graphon/entities/base_node_data.py (0ad455fb), src/graphon/nodes/
  {start,end,code,http_request,if_else,base}/entities.py (5fe93923), src/graphon/enums.py (07d87023),
  src/graphon/nodes/base/variable_template_parser.py (5fe93923), http_request/node.py (0c9a834e) and
  executor.py (49dfbeaa); the if/else Condition and its operators from Dify's
  api/core/workflow/utils/condition/entities.py (graphon.utils.condition is not in the index).
What this cannot show: that Dify's editor lays the graph out as drawn, that a given Dify version's
sandbox runs the Code nodes (they use the standard library's json only), and model nodes (there are none).
"""

from __future__ import annotations

import json
import random
import re
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from packaging.version import Version

from gateway.api.app import create_app
from gateway.ledger.ledger import Ledger
from gateway.push.dispatch import Dispatcher
from gateway.push.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app

DIFY = Path(__file__).resolve().parents[1] / "examples" / "platforms" / "dify"
TEMPLATE = DIFY / "pull-loop.yml"
PROFILE = {"title": "data engineer", "skills": ["python", "sql", "airflow", "spark", "dbt"]}
SKILLS = ["python", "sql", "airflow", "spark", "dbt", "kafka", "go", "react", "k8s", "terraform"]

# --- copied from Dify's source (see the module docstring) -------------------------------------------
CURRENT_DSL_VERSION = "0.6.0"  # api/constants/dsl_version.py
# BaseNodeData: only `type` has no default (title "", desc None, version "1", error_strategy None,
# default_value None, retry_config RetryConfig(max_retries=0, retry_interval=0, retry_enabled=False)).
BASE_REQUIRED = {"type"}
# fields without a default, per node data class
REQUIRED = {
    "start": set(),                                                    # StartNodeData: variables=[]
    "end": {"outputs"},                                                # EndNodeData
    "code": {"variables", "code_language", "code", "outputs"},         # CodeNodeData
    "http-request": {"method", "url", "authorization", "headers", "params"},  # HttpRequestNodeData
    "if-else": set(),                                                  # IfElseNodeData: cases=None
}
START_VARIABLE_REQUIRED = {"variable", "label", "type"}              # VariableEntity
START_VARIABLE_TYPES = {"text-input", "select", "paragraph", "number", "external_data_tool", "file",
                        "file-list", "checkbox", "json_object"}      # VariableEntityType
OUTPUT_VARIABLE_REQUIRED = {"variable", "value_selector"}            # OutputVariableEntity (end)
VARIABLE_SELECTOR_REQUIRED = {"variable", "value_selector"}          # VariableSelector (code)
CODE_LANGUAGES = {"python3", "javascript"}                           # CodeNodeData.code_language
CODE_OUTPUT_TYPES = {"string", "number", "object", "boolean", "array[string]", "array[number]",
                     "array[object]", "array[boolean]"}              # _ALLOWED_OUTPUT_FROM_CODE
HTTP_METHODS = {"get", "post", "put", "patch", "delete", "head", "options"}  # (and upper case)
HTTP_AUTH_TYPES = {"no-auth", "api-key"}                            # HttpRequestNodeAuthorization
HTTP_BODY_TYPES = {"none", "form-data", "x-www-form-urlencoded", "raw-text", "json", "binary"}
BODY_DATA_TYPES = {"file", "text"}                                   # BodyData.type
HTTP_OUTPUTS = {"status_code", "body", "headers", "files"}          # HttpRequestNode._run outputs
CASE_REQUIRED = {"case_id", "logical_operator", "conditions"}       # IfElseNodeData.Case
CONDITION_REQUIRED = {"variable_selector", "comparison_operator"}   # Condition
COMPARISON_OPERATORS = {"contains", "not contains", "start with", "end with", "is", "is not", "empty",
                        "not empty", "in", "not in", "all of", "=", "≠", ">", "<", "≥", "≤", "null",
                        "not null", "exists", "not exists"}         # SupportedComparisonOperator
ERROR_STRATEGIES = {"fail-branch", "default-value"}                 # ErrorStrategy
CONTINUE_ON_ERROR_NODE_TYPES = {"llm", "code", "tool", "http-request"}  # CONTINUE_ON_ERROR_NODE_TYPE
FAIL_BRANCH_HANDLES = {"success-branch", "fail-branch"}             # FailBranchSourceHandle
FAIL_BRANCH_OUTPUTS = {"error_message", "error_type"}               # error handler's outputs
IF_ELSE_ELSE_HANDLE = "false"                                        # the else branch's sourceHandle
SELECTOR_PATTERN = re.compile(  # variable_template_parser.SELECTOR_PATTERN
    r"\{\{(#[a-zA-Z0-9_]{1,50}(?:\.[a-zA-Z_][a-zA-Z0-9_]{0,29}){1,10}#)\}\}")
BODY_TYPE_TO_CONTENT_TYPE = {"json": "application/json", "raw-text": "text/plain"}  # executor.py


def check_version_compatibility(imported: str, current: str) -> str:
    """api/services/dsl_version.py: pending (the user must confirm), completed-with-warnings, completed."""
    imported_v, current_v = Version(imported), Version(current)
    if imported_v > current_v or imported_v.major < current_v.major:
        return "pending"
    if imported_v.minor < current_v.minor:
        return "completed-with-warnings"
    return "completed"
# ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dsl() -> dict:
    return yaml.safe_load(TEMPLATE.read_text())


def nodes_of(dsl: dict) -> dict[str, dict]:
    return {node["id"]: node["data"] for node in dsl["workflow"]["graph"]["nodes"]}


def by_title(dsl: dict, title: str) -> tuple[str, dict]:
    return next((nid, data) for nid, data in nodes_of(dsl).items() if data["title"] == title)


def test_the_dsl_imports_without_a_confirmation_step(dsl):
    """What AppDslService.import_app checks before it builds the app."""
    assert dsl["kind"] == "app" and isinstance(dsl["version"], str)
    assert check_version_compatibility(dsl["version"], CURRENT_DSL_VERSION) != "pending"
    # 0.1.5: the oldest version whose Dify has fail branches (0.14+); every later Dify upgrades it
    assert Version(dsl["version"]) >= Version("0.1.5")
    assert dsl["app"]["mode"] == "workflow" and dsl["app"]["name"]
    workflow = dsl["workflow"]
    assert isinstance(workflow, dict) and workflow["graph"]["nodes"] and workflow["graph"]["edges"]
    for env in workflow["environment_variables"]:  # variable_factory.build_environment_variable_from_mapping
        assert env["name"] and env["value_type"] in ("string", "secret", "number")
        assert env["value"] is not None
    secret = {e["name"]: e for e in workflow["environment_variables"]}["batchgate_token"]
    assert secret["value_type"] == "secret" and secret["value"] == ""  # no token in the file


def test_every_node_has_what_its_schema_requires(dsl):
    for nid, data in nodes_of(dsl).items():
        kind = data["type"]
        assert kind in REQUIRED, f"{nid}: node type {kind} is not one this test knows"
        missing = (BASE_REQUIRED | REQUIRED[kind]) - set(data)
        assert not missing, f"{data.get('title')}: missing {missing}"
        assert data.get("title"), nid
        if "error_strategy" in data:
            assert data["error_strategy"] in ERROR_STRATEGIES and kind in CONTINUE_ON_ERROR_NODE_TYPES
        retry = data.get("retry_config", {})
        assert set(retry) <= {"max_retries", "retry_interval", "retry_enabled"}
        assert all(isinstance(retry.get(k, 0), int) for k in ("max_retries", "retry_interval"))
        CHECKS[kind](data)


def check_start(data: dict) -> None:
    for var in data.get("variables", []):
        assert START_VARIABLE_REQUIRED <= set(var) and var["type"] in START_VARIABLE_TYPES, var


def check_end(data: dict) -> None:
    assert data["outputs"]
    for out in data["outputs"]:
        assert OUTPUT_VARIABLE_REQUIRED <= set(out) and len(out["value_selector"]) >= 2, out


def check_code(data: dict) -> None:
    assert data["code_language"] in CODE_LANGUAGES and data["code"].strip()
    for var in data["variables"]:
        assert VARIABLE_SELECTOR_REQUIRED <= set(var), var
    assert data["outputs"]
    for out in data["outputs"].values():
        assert out["type"] in CODE_OUTPUT_TYPES, out
    compile(data["code"], data["title"], "exec")
    args = re.search(r"^def main\(([^)]*)\)", data["code"], re.M)
    assert args, f"{data['title']}: no main()"
    assert [a.split(":")[0].strip() for a in args.group(1).split(",")] == [v["variable"] for v in
                                                                         data["variables"]]


def check_http(data: dict) -> None:
    assert data["method"].lower() in HTTP_METHODS and isinstance(data["url"], str) and data["url"]
    auth = data["authorization"]
    assert auth["type"] in HTTP_AUTH_TYPES and (auth["type"] == "no-auth" or isinstance(auth["config"], dict))
    assert isinstance(data["headers"], str) and isinstance(data["params"], str)
    body = data.get("body")
    if body:
        assert body["type"] in HTTP_BODY_TYPES
        assert all(item["type"] in BODY_DATA_TYPES for item in body["data"])
        if body["type"] in ("json", "raw-text"):
            assert len(body["data"]) == 1  # executor: "json body type should have exactly one item"
    for part in ("connect", "read", "write"):
        assert isinstance((data.get("timeout") or {}).get(part, 0), int | None)


def check_if_else(data: dict) -> None:
    assert data["cases"]
    for case in data["cases"]:
        assert CASE_REQUIRED <= set(case) and case["logical_operator"] in ("and", "or")
        for cond in case["conditions"]:
            assert CONDITION_REQUIRED <= set(cond) and cond["comparison_operator"] in COMPARISON_OPERATORS


CHECKS: dict[str, Callable[[dict], None]] = {"start": check_start, "end": check_end, "code": check_code,
                                              "http-request": check_http, "if-else": check_if_else}


def outputs_of(data: dict) -> set[str]:
    """The variables a node puts into the pool (what a selector may name after its node id)."""
    kind = data["type"]
    names = {"start": lambda: {v["variable"] for v in data.get("variables", [])},
             "code": lambda: set(data["outputs"]), "http-request": lambda: set(HTTP_OUTPUTS),
             "end": lambda: {o["variable"] for o in data["outputs"]}, "if-else": set}[kind]()
    if data.get("error_strategy") == "fail-branch":
        names |= FAIL_BRANCH_OUTPUTS
    return names


def ancestors(dsl: dict, nid: str) -> set[str]:
    parents: dict[str, set[str]] = {}
    for edge in dsl["workflow"]["graph"]["edges"]:
        parents.setdefault(edge["target"], set()).add(edge["source"])
    seen, todo = set(), [nid]
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_the_graph_is_whole(dsl):
    """Edges join existing nodes through handles their source has; every node is reachable from the one
    Start; every selector and template names a variable an upstream node (or env) provides."""
    nodes = nodes_of(dsl)
    assert len(nodes) == len(dsl["workflow"]["graph"]["nodes"])  # ids unique
    starts = [nid for nid, d in nodes.items() if d["type"] == "start"]
    assert len(starts) == 1
    handles: dict[str, set[str]] = {}
    for edge in dsl["workflow"]["graph"]["edges"]:
        src, dst = nodes.get(edge["source"]), nodes.get(edge["target"])
        assert src is not None and dst is not None, edge
        assert edge["data"]["sourceType"] == src["type"] and edge["data"]["targetType"] == dst["type"], edge
        assert edge["targetHandle"] == "target"
        if src["type"] == "if-else":
            assert edge["sourceHandle"] in {c["case_id"] for c in src["cases"]} | {IF_ELSE_ELSE_HANDLE}
        elif src.get("error_strategy") == "fail-branch":
            assert edge["sourceHandle"] in FAIL_BRANCH_HANDLES
        else:
            assert edge["sourceHandle"] == "source"
        assert edge["sourceHandle"] not in handles.setdefault(edge["source"], set()), edge  # one edge each
        handles[edge["source"]].add(edge["sourceHandle"])
    for nid, data in nodes.items():
        if data["type"] == "end":
            assert nid not in handles
        elif data["type"] == "if-else":
            assert handles[nid] == {c["case_id"] for c in data["cases"]} | {IF_ELSE_ELSE_HANDLE}
        elif data.get("error_strategy") == "fail-branch":
            assert handles[nid] == FAIL_BRANCH_HANDLES, data["title"]
        else:
            assert handles[nid] == {"source"}, data["title"]
        if nid != starts[0]:
            assert starts[0] in ancestors(dsl, nid), f"{data['title']} is not reachable from Start"

    env = {e["name"] for e in dsl["workflow"]["environment_variables"]}
    for nid, data in nodes.items():
        for selector in selectors_in(data):
            source, name = selector[0], selector[1]
            if source == "env":
                assert name in env, selector
                continue
            assert source in ancestors(dsl, nid), f"{data['title']} reads {selector} from a later node"
            assert name in outputs_of(nodes[source]), f"{data['title']}: no {name} in {source}"


def selectors_in(data: dict) -> list[list[str]]:
    found = [v["value_selector"] for v in data.get("variables", []) if "value_selector" in v]
    if data["type"] == "end":
        found += [o["value_selector"] for o in data["outputs"]]
    if data["type"] == "if-else":
        found += [c["variable_selector"] for case in data["cases"] for c in case["conditions"]]
    if data["type"] == "http-request":
        texts = [data["url"], data["headers"], data["params"]]
        texts += [item.get("value", "") for item in (data.get("body") or {}).get("data", [])]
        for text in texts:
            for braces in re.findall(r"\{\{.*?\}\}", text):  # every template must be one Dify renders
                assert SELECTOR_PATTERN.fullmatch(braces), braces
            found += [m[1:-1].split(".") for m in SELECTOR_PATTERN.findall(text)]
    return found


def test_the_http_nodes_call_batchgate_as_its_readme_says(dsl):
    start_id, _ = by_title(dsl, "Start")
    parse_id, _ = by_title(dsl, "Parse lease")
    calls = {data["title"]: data for data in nodes_of(dsl).values() if data["type"] == "http-request"}
    assert set(calls) == {"Lease", "Complete", "Fail"}
    base = "{{#env.batchgate_url#}}/v1/jobs/"
    batch = base + f"{{{{#{parse_id}.job_id#}}}}/batches/{{{{#{parse_id}.seq#}}}}"
    assert calls["Lease"]["url"] == base + f"{{{{#{start_id}.job_id#}}}}/lease"
    assert calls["Complete"]["url"] == batch + "/complete" and calls["Fail"]["url"] == batch + "/fail"
    for data in calls.values():
        assert data["method"] == "post" and data["body"]["type"] == "json"
        assert data["headers"] == "Authorization:Bearer {{#env.batchgate_token#}}"
    assert calls["Lease"]["body"]["data"][0]["value"] == "{}"
    # a complete or fail is safe to repeat (the same token gets the first answer back): retried
    assert all(calls[name]["retry_config"]["retry_enabled"] for name in ("Complete", "Fail"))
    assert not calls["Lease"].get("retry_config", {}).get("retry_enabled")  # a 204 is an answer, not an error


# --- running the template against a real batchgate -----------------------------------------------------


class Run:
    """One run of the workflow app, walked the way Dify's graph engine walks it."""

    def __init__(self, dsl: dict, env: dict[str, str], inputs: dict[str, Any],
                 session: requests.Session) -> None:
        self.nodes = nodes_of(dsl)
        edges = dsl["workflow"]["graph"]["edges"]
        self.edges = {(e["source"], e["sourceHandle"]): e["target"] for e in edges}
        self.pool: dict[str, dict[str, Any]] = {"env": dict(env)}
        self.inputs, self.session = inputs, session  # retries go at once: their interval is Dify's
        self.requests: list[dict] = []
        self.path: list[str] = []

    def go(self) -> tuple[str, dict]:
        """Run from Start to an End; (the End's title, its outputs)."""
        nid = next(nid for nid, data in self.nodes.items() if data["type"] == "start")
        while True:
            data = self.nodes[nid]
            assert nid not in self.path, f"{data['title']} ran twice"
            self.path.append(nid)
            if data["type"] == "end":
                return data["title"], {o["variable"]: self.get(o["value_selector"]) for o in data["outputs"]}
            handle = getattr(self, data["type"].replace("-", "_"))(nid, data)
            nid = self.edges[(nid, handle)]

    def get(self, selector: list[str]) -> Any:
        value: Any = self.pool.get(selector[0], {})
        for key in selector[1:]:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    def render(self, template: str) -> str:
        def text(match: re.Match) -> str:
            value = self.get(match.group(1)[1:-1].split("."))
            if value is None:
                return ""
            return value if isinstance(value, str) else json.dumps(value)
        return SELECTOR_PATTERN.sub(text, template)

    def start(self, nid: str, data: dict) -> str:
        for var in data["variables"]:
            assert not var.get("required") or self.inputs.get(var["variable"]), var
            assert len(self.inputs[var["variable"]]) <= var.get("max_length", 10**9)
        self.pool[nid] = dict(self.inputs)
        return "source"

    def http_request(self, nid: str, data: dict) -> str:
        url = self.render(data["url"])
        assert url.startswith(("http://", "https://")), url
        headers = {k.strip(): v.strip() for line in self.render(data["headers"]).splitlines() if line.strip()
                   for k, v in [line.split(":", 1)]}
        body = data["body"]
        json_body = json.loads(self.render(body["data"][0]["value"]), strict=False)
        headers.setdefault("Content-Type", BODY_TYPE_TO_CONTENT_TYPE[body["type"]])
        retry = data.get("retry_config", {})
        tries = 1 + (retry.get("max_retries", 0) if retry.get("retry_enabled") else 0)
        for _ in range(tries):
            resp = self.session.request(data["method"].upper(), url, data=json.dumps(json_body),
                                        headers=headers, timeout=30)
            self.requests.append({"node": data["title"], "url": url, "json": json_body,
                                  "status": resp.status_code})
            fails_node = retry.get("retry_enabled") or data.get("error_strategy")
            if 200 <= resp.status_code < 300 or not fails_node:
                break  # http_request/node.py: a non-2xx fails the node only with a retry or error strategy
        outputs = {"status_code": resp.status_code, "body": resp.text,
                   "headers": {k.lower(): v for k, v in resp.headers.items()}, "files": []}
        if not 200 <= resp.status_code < 300 and (retry.get("retry_enabled") or data.get("error_strategy")):
            assert data.get("error_strategy") == "fail-branch", f"{data['title']} would fail the run"
            self.pool[nid] = {"error_message": f"Request failed with status code {resp.status_code}",
                              "error_type": "HTTPResponseCodeError"}
            return "fail-branch"
        self.pool[nid] = outputs
        return "success-branch" if data.get("error_strategy") == "fail-branch" else "source"

    def code(self, nid: str, data: dict) -> str:
        namespace: dict[str, Any] = {}
        exec(compile(data["code"], data["title"], "exec"), namespace)  # noqa: S102 - the template's own code
        args = {v["variable"]: self.get(v["value_selector"]) for v in data["variables"]}
        try:
            result = namespace["main"](**args)
        except Exception as exc:  # Dify's sandbox answers the traceback: the error message carries it
            assert data.get("error_strategy") == "fail-branch", f"{data['title']} raised {exc!r}"
            self.pool[nid] = {"error_message": "".join(traceback.format_exception_only(exc)).strip(),
                              "error_type": "CodeNodeError"}
            return "fail-branch"
        assert set(result) == set(data["outputs"]), (data["title"], result)
        types = {"string": str, "number": int | float, "object": dict, "array[object]": list}
        for name, spec in data["outputs"].items():
            assert isinstance(result[name], types[spec["type"]]), (data["title"], name, result[name])
        self.pool[nid] = result
        return "success-branch" if data.get("error_strategy") == "fail-branch" else "source"

    def if_else(self, nid: str, data: dict) -> str:
        ops = {"=": lambda a, b: float(a) == float(b), "is": lambda a, b: str(a) == str(b)}
        for case in data["cases"]:
            results = [ops[c["comparison_operator"]](self.get(c["variable_selector"]), c["value"])
                       for c in case["conditions"]]
            if (all if case["logical_operator"] == "and" else any)(results):
                return case["case_id"]
        return IF_ELSE_ELSE_HANDLE


def expected_score(resume: dict) -> int:
    wanted = {s.lower() for s in PROFILE["skills"]}
    overlap = len({s.lower() for s in resume["skills"]} & wanted)
    return min(100, int(70 * overlap / len(wanted) + 0.5) + min(int(resume["years"]), 10) * 3)


def make_resumes(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"id": f"r{i:04d}", "name": f"Candidate {i}", "years": rng.randint(0, 15),
             "skills": rng.sample(SKILLS, rng.randint(2, 6))} for i in range(count)]


@pytest.fixture
def batchgate(settings, redis_client, tmp_path):
    """batchgate's API on a real socket, with the template's flow registered, and a supervisor."""
    own = settings.model_copy(update={"data_dir": tmp_path / "data",
                                      "supervisor_interval": timedelta(milliseconds=100)})
    base, stop_api = serve_app(create_app(own, redis_client))
    ledger = Ledger(redis_client, own)
    sup = Supervisor(ledger, name="dify-template", dispatcher=Dispatcher.build(own, ledger))
    threading.Thread(target=sup.run, daemon=True).start()
    api = ApiClient(base, TOKEN)
    flow = yaml.safe_load((DIFY / "pull-flow.yaml").read_text())
    assert flow["stages"][0]["lease"] >= 300 and "target" not in flow["stages"][0]  # pull, sized for a run
    flow["batching"]["max_items"] = 5
    flow["tolerated_failure_percentage"] = 50
    flow["stages"][0]["retry"] = {"initial_interval": 0.05, "maximum_attempts": 3}
    assert api.post("/v1/flows", json=flow).status_code == 201
    yield base, api, flow
    sup.stop.set()
    stop_api()


def run_until_idle(dsl: dict, base: str, job_id: str, limit: int = 30) -> list[tuple[str, dict, Run]]:
    """Call the app as a scheduler would: again while a run leased a batch (outputs carry seq)."""
    runs = []
    session = requests.Session()
    for _ in range(limit):
        run = Run(dsl, {"batchgate_url": base, "batchgate_token": TOKEN}, {"job_id": job_id}, session)
        end, outputs = run.go()
        runs.append((end, outputs, run))
        if "job_status" in outputs and outputs["job_status"] != "running":
            return runs
    raise AssertionError(f"still leasing after {limit} runs: {[r[0] for r in runs]}")


def test_the_template_runs_a_whole_job_against_batchgate(dsl, batchgate):
    base, api, flow = batchgate
    resumes = make_resumes(12, seed=5)
    job_id = api.post("/v1/jobs", json={"flow_id": flow["id"], "params": {"profile": PROFILE},
                                        "source": {"type": "inline", "items": resumes}}).json()["job_id"]
    runs = run_until_idle(dsl, base, job_id)
    assert [end for end, _, _ in runs] == ["Committed"] * 3 + ["Nothing leased"]
    assert [out["seq"] for _, out, _ in runs[:3]] == ["0", "1", "2"]
    assert all(out["status_code"] == 200 and json.loads(out["answer"])["status"] for _, out, _ in runs[:3])
    assert runs[-1][1] == {"job_status": "succeeded", "status_code": 204}
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["items_done"] == 12
    scores = {}
    for seq in range(3):
        scores.update(api.get(f"/v1/jobs/{job_id}/batches/{seq}").json()["stages"]["score"]["output"]["scores"])
    assert scores == {r["id"]: expected_score(r) for r in resumes}
    first = runs[0][2].requests
    assert [r["node"] for r in first] == ["Lease", "Complete"]
    assert first[0]["url"] == f"{base}/v1/jobs/{job_id}/lease" and first[0]["json"] == {}
    assert first[1]["url"] == f"{base}/v1/jobs/{job_id}/batches/0/complete"
    assert set(first[1]["json"]) == {"lease_token", "output"}


def failing_dsl(dsl: dict) -> dict:
    """The template with lines put before the placeholder's code: batch 1 raises a fatal error, batch 2
    a retryable one on its first attempt (the attempt is read from the Parse lease node's output)."""
    copy = json.loads(json.dumps(dsl))
    parse_id, _ = by_title(copy, "Parse lease")
    _, process = by_title(copy, "Process batch (replace me)")
    process["variables"].append({"variable": "attempt", "value_selector": [parse_id, "attempt"]})
    process["variables"].append({"variable": "seq", "value_selector": [parse_id, "seq"]})
    process["code"] = process["code"].replace("def main(items: list, params: dict) -> dict:\n", (
        "def main(items: list, params: dict, attempt: int, seq: str) -> dict:\n"
        "    if seq == '1':\n"
        "        raise ValueError('fatal: resume batch 1 cannot be read')\n"
        "    if seq == '2' and attempt == 1:\n"
        "        raise TimeoutError('model timed out')\n"))
    return copy


def test_the_fail_branch_reports_fatal_and_retryable_failures(dsl, batchgate):
    base, api, flow = batchgate
    resumes = make_resumes(15, seed=6)
    job_id = api.post("/v1/jobs", json={"flow_id": flow["id"], "params": {"profile": PROFILE},
                                        "source": {"type": "inline", "items": resumes}}).json()["job_id"]
    runs = run_until_idle(failing_dsl(dsl), base, job_id)
    fails = [(out["seq"], run.requests[-1]["json"]["error"]) for end, out, run in runs if end == "Failed"]
    assert [(seq, err["retryable"]) for seq, err in fails] == [("1", False), ("2", True)], fails
    assert "fatal: resume batch 1 cannot be read" in fails[0][1]["message"]
    job = api.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["items_done"] == 10, job  # within its failure budget
    assert api.get(f"/v1/jobs/{job_id}/batches/1").json()["status"] == "failed"
    retried = api.get(f"/v1/jobs/{job_id}/batches/2").json()
    assert retried["status"] == "completed" and retried["attempt"] == 2


def test_a_run_whose_lease_ran_out_ends_not_accepted(dsl, batchgate, redis_client):
    """A run slower than the lease: its complete is stale (409, retried, refused) and the batch is
    leased again; the run ends in "Not accepted" rather than failing."""
    base, api, flow = batchgate
    flow = {**flow, "id": "dify-pull-short-lease", "stages": [{**flow["stages"][0], "lease": 0.3}]}
    assert api.post("/v1/flows", json=flow).status_code == 201
    source = {"type": "inline", "items": make_resumes(5, 8)}
    job_id = api.post("/v1/jobs", json={"flow_id": flow["id"], "params": {"profile": PROFILE},
                                        "source": source}).json()["job_id"]
    slow = json.loads(json.dumps(dsl))
    _, process = by_title(slow, "Process batch (replace me)")
    process["code"] = "import time\n" + process["code"].replace(
        "    profile = params.get", "    time.sleep(1.0)  # past the 0.3 s lease\n    profile = params.get")
    run = Run(slow, {"batchgate_url": base, "batchgate_token": TOKEN}, {"job_id": job_id}, requests.Session())
    end, outputs = run.go()
    assert end == "Not accepted" and outputs["seq"] == "0"
    assert outputs["complete_error"] == "Request failed with status code 409"
    assert outputs["fail_error"] is None
    completes = [r for r in run.requests if r["node"] == "Complete"]
    assert [r["status"] for r in completes] == [409] * 4  # the first try and 3 retries, all stale
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["status"] == "pending" and batch["stages"]["score"].get("output") is None, batch
    assert "lease expired" in batch["error"]
