"""Ledger Lua scripts: one .lua file per operation, each prefixed with lib.lua, registered once per client."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import redis
from redis.commands.core import Script

from gateway import tracing

OPERATIONS = (
    "plan", "lease", "heartbeat", "complete", "fail", "expire", "reopen", "replan", "set_status", "selfcheck",
    "slot", "cancel", "begin", "source_fail", "breaker", "outage", "unwait", "handle", "decide",
    "open_approval", "qretry",
    "compact", "amend", "rest", "archive",  # result sinks (docs/design.md "Result sinks and compaction")
)
#: Two operations run as one script, the second only when the first succeeded (pair_source): a pull
#: step's commit and the next lease in one round trip (Ledger.complete_and_lease).
PAIRS = {"complete_lease": ("complete", "lease")}


def source(name: str) -> str:
    """The full text of one script: the shared helpers it calls (lib.lua, trimmed: `helpers`), then the
    operation."""
    body = _read(name)
    return helpers(body) + "\n" + body


#: How long a script call's first answer is kept for a repeat of the call (ms): longer than a read
#: timeout and the retries after it (jobindex.JobIndex.run), short enough that the journal of a busy
#: job stays small (about 200 B per call, so 2 MB per 100 steps/s).
JOURNAL_MS = 120_000

#: Runs a script body with ARGV[1] (the journal key; '' = none) taken off, and answers {reply, moved}
#: (observed_source). A call whose journal key holds an answer is a repeat of a call that took effect:
#: it answers that first answer and does nothing else.
_JOURNALED = """
local __journal = ARGV[1]
if __journal ~= '' then
  local __raw = redis.call('GET', __journal)
  if __raw then
    local __seen = cjson.decode(__raw)
    return {{{fat}, __seen[2]}}
  end
end
local __argv = {{}}
for i = 2, #ARGV do __argv[i - 1] = ARGV[i] end
{run}
local __answer = {{__reply, STATUS_MOVED}}
if __journal ~= '' then
  redis.call('SET', __journal, cjson.encode({{{slim}, STATUS_MOVED}}), 'PX', {journal_ms})
end
return __answer
"""

#: A lease's answer carries its batch's items and the previous stage's output, and a 'plan' answer the
#: inline source's next items, which can be large: the journal keeps them by reference (blank, marked
#: 'ref') and a repeat reads them again from where the first call did (the batch's items key and
#: record, the job's src list), where they are as that call found them: no commit can come between a
#: lease and the repeat of that lease (only its holder commits), and src never changes. lease.lua answers
#: {'ok', seq, stage, attempt, deadline, start, end, items, input, gen} or {'plan', next_seq, frontier,
#: src length, src items...}; plan.lua leasing {'ok', seq, K, attempt, deadline, start, end, items, gen}
#: (stage 0, no input).
_LEASE_REFS = """
local function __slim(reply, n)
  if type(reply) ~= 'table' then return reply end
  if reply[1] == 'plan' and #reply > 3 then return {reply[1], reply[2], reply[3], 'ref'} end
  if reply[1] ~= 'ok' or #reply ~= n then return reply end
  local copy = {unpack(reply)}
  copy[8] = ''
  if n == 10 then copy[9] = '' end
  copy[n + 1] = 'ref'
  return copy
end
local function __fat(reply, n, job_key, ahead)
  if type(reply) ~= 'table' then return reply end
  local base = string.sub(job_key, 1, -5)
  if reply[1] == 'plan' and reply[4] == 'ref' then
    local cursor = cjson.decode(reply[3])
    reply[4] = redis.call('LLEN', base .. ':src')
    local window = redis.call('LRANGE', base .. ':src', cursor['offset'], cursor['offset'] + ahead - 1)
    for i = 1, #window do reply[4 + i] = window[i] end
    return reply
  end
  if reply[n + 1] ~= 'ref' then return reply end
  reply[n + 1] = nil
  reply[8] = redis.call('GET', base .. ':items:' .. reply[2]) or ''
  if n == 10 and tonumber(reply[3]) > 0 then
    reply[9] = redis.call('HGET', base .. ':batch:' .. reply[2], 'out:' .. (tonumber(reply[3]) - 1)) or ''
  end
  return reply
end
"""
#: per operation: (lib text the hooks need, how the journal keeps a reply, how a repeat restores it;
#: lease.lua's read-ahead is its ARGV[8], after the journal key ARGV[9]; complete_lease's is its ARGV
#: past the journal key, the two counts and complete's own)
_HOOKS = {
    "lease": (_LEASE_REFS, "__slim(__reply, 10)", "__fat(__seen[1], 10, KEYS[1], tonumber(ARGV[9]))"),
    "plan": (_LEASE_REFS, "__slim(__reply, 9)", "__fat(__seen[1], 9, KEYS[1], 0)"),
    "complete_lease": (_LEASE_REFS, "{__reply[1], __slim(__reply[2], 10)}",
                       "{__seen[1][1], __fat(__seen[1][2], 10, KEYS[1], "
                       "tonumber(ARGV[3 + tonumber(ARGV[3]) + 8]))}"),
}


def observed_source(name: str) -> str:
    """One operation's text as `Scripts` registers it: its body runs as a function and the script
    answers ``{reply, moved}``, where ``moved`` is '1' when the script changed a job record's status
    (lib.lua ``save`` notes it in STATUS_MOVED). The job index's observer reads ``moved`` to decide
    whether the job must be filed again, instead of reading the job's status back after every script
    (jobindex.JobIndex.run); every other caller gets ``reply`` alone (`Unwrapped`).

    ARGV[1] is the call's journal key (JobKeys.call, under the job's hash tag; '' for none), the
    operation's own ARGV follow: the first answer is kept there for JOURNAL_MS and a repeat of the call
    (the same key: a retry after a timeout, when the first call may have taken effect) answers it
    without running again. So every job script answers a repeat with its first answer, whatever it does
    (tests/test_repeat_calls.py)."""
    body = _read(name)
    run = ("local __reply = (function(KEYS, ARGV)\n" + body + "\nend)(KEYS, __argv)\n"
           "if __reply == nil then __reply = false end")
    return helpers(body, "STATUS_MOVED") + _journaled(name, run)


def _journaled(name: str, run: str) -> str:
    hooks, slim, fat = _HOOKS.get(name, ("", "__reply", "__seen[1]"))
    return hooks + _JOURNALED.format(run=run, journal_ms=JOURNAL_MS, slim=slim, fat=fat)


def pair_source(first: str, second: str) -> str:
    """Two operations as one script: ``first``, then ``second`` if ``first`` answered 'ok' or
    'duplicate', each with its own KEYS and ARGV. The caller passes ``first``'s KEYS then ``second``'s,
    and ARGV = [journal key, #first KEYS, #first ARGV, first's ARGV..., second's ARGV...]; the script
    answers ``{{first's reply, second's reply or nil}, moved}`` (observed_source). Each body runs as a
    function whose parameters KEYS and ARGV shadow the globals, so the operations' files are used
    unchanged; what one body loaded and saved the other reads from lib.lua's LOADED."""
    a, b = _read(first), _read(second)
    run = f"""local __nk, __na = tonumber(__argv[1]), tonumber(__argv[2])
local __k1, __a1, __k2, __a2 = {{}}, {{}}, {{}}, {{}}
for i = 1, #KEYS do
  if i <= __nk then __k1[#__k1 + 1] = KEYS[i] else __k2[#__k2 + 1] = KEYS[i] end
end
for i = 3, #__argv do
  if i - 2 <= __na then __a1[#__a1 + 1] = __argv[i] else __a2[#__a2 + 1] = __argv[i] end
end
local __first = (function(KEYS, ARGV)
{a}
end)(__k1, __a1)
if __first == nil then __first = false end
local __second = false
if type(__first) == 'table' and (__first[1] == 'ok' or __first[1] == 'duplicate') then
  __second = (function(KEYS, ARGV)
{b}
  end)(__k2, __a2)
  if __second == nil then __second = false end
end
local __reply = {{__first, __second}}"""
    return helpers(a + "\n" + b, "STATUS_MOVED") + _journaled(f"{first}_{second}", run)


@functools.cache
def _read(name: str) -> str:
    return (resources.files("gateway.ledger") / "lua" / f"{name}.lua").read_text()


@functools.cache
def _lib() -> tuple[tuple[str, frozenset[str], str], ...]:
    """lib.lua cut into its top-level definitions: (name, names it uses, text), in file order. A
    definition starts at a line opening with ``local`` at column 0 (the comment lines above it go with
    it)."""
    lines = _read("lib").splitlines(keepends=True)
    chunks: list[list[str]] = [[]]
    for line in lines:
        if line.startswith("local ") and any(not c.startswith("--") and c.strip() for c in chunks[-1]):
            chunks.append([])
        chunks[-1].append(line)
    out = []
    for chunk in chunks:
        text = "".join(chunk)
        head = next((c for c in chunk if c.startswith("local ")), None)
        if head is None:
            continue  # the file's opening comment
        m = _DEFINES.match(head)
        if m is None:
            raise ValueError(f"lib.lua: cannot tell what this defines: {head.strip()}")
        out.append((m.group(1), frozenset(_WORDS.findall(text)), text))
    return tuple(out)


_DEFINES = re.compile(r"local (?:function )?([A-Za-z_][A-Za-z0-9_]*)")
_WORDS = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def helpers(body: str, *always: str) -> str:
    """The lib.lua definitions ``body`` uses, directly or through other helpers, in lib.lua's order.

    Redis 6.2 (the embedded server) has no shared functions: every EVALSHA runs its helpers' definitions
    again, so a script carries only the ones it calls (about 7 us per call for the whole file,
    docs/benchmarks.md). A name that merely looks like a helper (a field ``k.log``) pulls it in too:
    harmless, the closure is only ever too big."""
    lib = _lib()
    defined = {name: uses for name, uses, _ in lib}
    want = set(always) | (set(_WORDS.findall(body)) & defined.keys())
    todo = list(want)
    while todo:
        for used in defined[todo.pop()] & defined.keys():
            if used not in want:
                want.add(used)
                todo.append(used)
    return "".join(text for name, _, text in lib if name in want)


class Observer(Protocol):
    """Hears of every script run that names a job's record (jobindex.JobIndex)."""

    def job_in(self, keys: list) -> str | None: ...

    def run(self, script: Script, job_id: str, keys: list, args: list) -> Any: ...


class Observed:
    """A registered script whose runs on a job go through the observer (the job index follows every
    status change this way, present scripts and future ones alike). Called like a redis-py Script."""

    def __init__(self, script: Script, observer: Observer) -> None:
        self.script = script
        self.observer = observer

    def __call__(self, keys: list | tuple = (), args: list | tuple = (), client: Any = None) -> Any:
        job_id = self.observer.job_in(keys) if client is None else None
        if job_id is None:
            return self.script(keys=keys, args=args, client=client)
        if not tracing.enabled():
            return self.observer.run(self.script, job_id, list(keys), list(args))
        # the observer sends the script by its sha in its own round trip: the span is taken here
        with tracing.span(getattr(self.script, "name", "ledger.script"), kind="client",
                          **{"db.system": "redis"}):
            return self.observer.run(self.script, job_id, list(keys), list(args))


@dataclass(frozen=True)
class Scripts:
    """The registered scripts of one Redis client, by operation name."""

    plan: Script
    lease: Script
    heartbeat: Script
    complete: Script
    fail: Script
    expire: Script
    reopen: Script
    replan: Script
    set_status: Script
    selfcheck: Script
    slot: Script
    cancel: Script
    begin: Script
    source_fail: Script
    breaker: Script
    outage: Script
    unwait: Script
    handle: Script
    decide: Script
    open_approval: Script
    qretry: Script
    compact: Script
    amend: Script
    rest: Script
    archive: Script
    complete_lease: Script

    @classmethod
    def register(cls, client: redis.Redis, observer: Observer | None = None) -> Scripts:
        """Register every operation's script with ``client`` (EVALSHA, loaded on first use); with an
        ``observer``, each run that names a job's record goes through it (Observed)."""
        made = {name: Traced(name, Unwrapped(client.register_script(observed_source(name))))
                for name in OPERATIONS}
        made.update({name: Traced(name, Unwrapped(client.register_script(pair_source(*ops))))
                     for name, ops in PAIRS.items()})
        if observer is not None:  # outermost: ``.script`` stays the bare (traced) script
            made = {name: Observed(script, observer) for name, script in made.items()}
        return cls(**made)


class Traced:
    """A script whose runs are spans (``ledger.<operation>``) when tracing is on (gateway/tracing.py)."""

    def __init__(self, name: str, script: Any) -> None:
        self.name = f"ledger.{name}"
        self.script = script

    def __call__(self, keys: list | tuple = (), args: list | tuple = (), client: Any = None) -> Any:
        if not tracing.enabled():
            return self.script(keys=keys, args=args, client=client)
        with tracing.span(self.name, kind="client", **{"db.system": "redis"}):
            return self.script(keys=keys, args=args, client=client)

    def __getattr__(self, attr: str) -> Any:  # sha, script text, ... of the wrapped script
        return getattr(self.script, attr)


class Unwrapped:
    """A script registered from `observed_source`, called as redis-py calls it: answers its reply alone
    (the observer, which sends it by its sha itself, reads the ``moved`` flag too)."""

    def __init__(self, script: Script) -> None:
        self.script = script

    def __call__(self, keys: list | tuple = (), args: list | tuple = (), client: Any = None) -> Any:
        return unwrap(self.script(keys=keys, args=["", *args], client=client))[0]  # no journal

    def __getattr__(self, attr: str) -> Any:  # sha, script text, ... of the wrapped script
        return getattr(self.script, attr)


def unwrap(answer: Any) -> tuple[Any, bool]:
    """An `observed_source` script's answer as (reply, moved); a reply that is an error is raised here,
    as redis-py raises a script's top-level error."""
    reply, moved = answer
    if isinstance(reply, Exception):
        raise reply
    return reply, moved == "1"
