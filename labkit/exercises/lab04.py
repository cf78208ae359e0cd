"""Notebook 04 (continuous batching): one scheduling step, preemption, latency metrics."""
from __future__ import annotations

from collections import deque
from typing import Any, Callable

from labkit.engine import Request, admit, preempt_newest
from labkit.exercises.spec import Case, Exercise, SaysWhatToDo, Scenario, _short
from labkit.generate import SamplingParams
from labkit.paged import BlockAllocator

State = tuple[deque, list, BlockAllocator]


def _request(name: str, prompt_len: int, first_token: int = 1, output: int = 0) -> Request:
    request = Request(name, list(range(first_token, first_token + prompt_len)), SamplingParams(max_new_tokens=64))
    request.output = [7] * output
    return request


def _running(allocator: BlockAllocator, *requests: Request) -> list[Request]:
    """Requests already admitted and computed up to their last token (decoding)."""
    for request in requests:
        allocator.add_sequence(request.request_id, request.tokens)
        allocator.mark_computed(request.request_id, request.tokens[:-1])
        request.num_computed, request.status = request.num_tokens - 1, "running"
    return list(requests)


def _summary(state: State, result: Any) -> tuple:
    """What a scheduling function must leave behind: the result (requests by their ids), the queues (ids), the
    pool's free blocks and tables, and each request's progress."""
    waiting, running, allocator = state
    allocator.check()
    requests = list(waiting) + running
    return (_returned(result), [r.request_id for r in waiting], [r.request_id for r in running],
            {s: len(t) for s, t in allocator.tables.items()}, allocator.num_free,
            {r.request_id: (r.num_computed, r.status, r.preemptions, r.output) for r in requests})


def _returned(result: Any) -> Any:
    """A returned request as ``request r0``; a list of (request, tokens) pairs as such pairs; anything else as
    what it is, so that an id or a pair of another shape never matches a request."""
    if isinstance(result, Request):
        return f"request {result.request_id}"
    if isinstance(result, list):
        return [(_returned(item[0]), item[1]) if isinstance(item, tuple) and len(item) == 2
                and isinstance(item[0], Request) else f"{_short(item)}, not a (request, tokens) pair"
                for item in result]
    if isinstance(result, str):
        return f"the id {result!r}, not the request"
    return f"{_short(result)}, of type {type(result).__name__}"


_FIELDS = ("returned", "waiting (ids, front first)", "running (ids)", "blocks per sequence", "free blocks",
           "each request's (num_computed, status, preemptions, output)")  # which sequence holds blocks, then how many


def _scenario(label: str, build: Callable[[], tuple[State, tuple]], reference: Callable[..., Any],
              hint: str) -> Scenario:
    """Run the reference and the student's function on two fresh copies of the same state and
    compare everything each left behind."""
    def play(fn: Callable[..., Any]) -> None:
        state, extra = build()
        expected = _summary(state, reference(*state, *extra))
        state, extra = build()
        result = fn(*state, *extra)
        if isinstance(result, list) and any(isinstance(item, tuple) and item[1:] == (0,) for item in result):
            raise SaysWhatToDo("a request admitted with 0 tokens scheduled: once the budget is spent, admit no one "
                               "(the loop runs while the budget is above 0)")
        _refuse_waiting_with_blocks(*state, reference)
        got = _summary(state, result)
        for name, want, have in zip(_FIELDS, expected, got):
            if want != have:
                raise AssertionError(f"{name} should be {want}, got {have}")  # check names the case
    return Scenario(label, play, hint=hint)


_HELD = {admit: "a request given blocks must be admitted: check the budget and the cap before add_sequence",
         preempt_newest: "a request sent back to waiting must give its blocks back: allocator.free(request_id)"}


def _refuse_waiting_with_blocks(waiting: deque, running: list, allocator: BlockAllocator,
                                reference: Callable[..., Any]) -> None:
    """SaysWhatToDo where a request left waiting holds blocks (which of the exercise's steps leaks them:
    ``_HELD``), or sits in both queues; nothing where no waiting request holds blocks."""
    runs = {r.request_id for r in running}
    if both := [str(r.request_id) for r in waiting if r.request_id in runs]:
        raise SaysWhatToDo(f"{', '.join(both)} {'is' if len(both) == 1 else 'are'} both waiting and running: take "
                           f"{'it' if len(both) == 1 else 'them'} off waiting (waiting.popleft())")
    if held := [str(r.request_id) for r in waiting if r.request_id in allocator.tables]:
        raise SaysWhatToDo(f"{', '.join(held)} {'waits' if len(held) == 1 else 'wait'} but still "
                           f"hold{'s' * (len(held) == 1)} blocks: {_HELD[reference]}")


def _admit_cases() -> list[Scenario]:
    def queue(*lengths: int) -> deque:
        return deque(_request(f"r{i}", n, first_token=100 * i) for i, n in enumerate(lengths))

    def fits_all() -> tuple[State, tuple]:
        return (queue(5, 3, 4), [], BlockAllocator(16, 4)), (64, 8)

    def budget_chunks() -> tuple[State, tuple]:  # the third prompt gets what is left of the budget
        return (queue(6, 5, 9), [], BlockAllocator(16, 4)), (16, 8)

    def one_token_left() -> tuple[State, tuple]:  # the first prompt leaves 1 of the budget: a chunk of one
        return (queue(6, 9, 3), [], BlockAllocator(16, 4)), (7, 8)

    def seq_cap() -> tuple[State, tuple]:  # one runs already: two more of the three may join
        allocator = BlockAllocator(16, 4)
        return (queue(2, 2, 2), _running(allocator, _request("old", 3, first_token=900)), allocator), (64, 3)

    def preempted() -> tuple[State, tuple]:  # back after a preemption: its prompt and its 4 outputs run again
        back = _request("back", 5, first_token=300, output=4)
        back.preemptions = 1
        return (deque([back, _request("r1", 4, first_token=500)]), [], BlockAllocator(16, 4)), (64, 8)

    def out_of_blocks() -> tuple[State, tuple]:  # the second needs 4 blocks, 3 are left: it and all after wait
        allocator = BlockAllocator(6, 4)
        running = _running(allocator, _request("old", 6, first_token=900))
        return (queue(4, 13, 1), running, allocator), (64, 8)

    def cached_prefix() -> tuple[State, tuple]:  # r0 shares 8 computed tokens with "old": only 3 to run
        allocator = BlockAllocator(16, 4)
        running = _running(allocator, _request("old", 10))
        return (deque([_request("r0", 11), _request("r1", 4, first_token=500)]), running, allocator), (5, 8)

    def prefix_makes_room() -> tuple[State, tuple]:  # r0 needs 3 blocks, 2 are free, but 2 of its 3 are cached
        allocator = BlockAllocator(5, 4)
        running = _running(allocator, _request("old", 10))
        return (deque([_request("r0", 11), _request("r1", 4, first_token=500)]), running, allocator), (64, 8)

    def empty_budget() -> tuple[State, tuple]:
        return (queue(3), [], BlockAllocator(4, 4)), (0, 8)

    return [_scenario(label, build, admit, hint) for label, build, hint in [
        ("three prompts that all fit", fits_all,
         "budget, cap and blocks all suffice: every request is admitted, in arrival order, with its whole prompt "
         "scheduled, nothing computed yet (num_computed 0) and its status 'running'"),
        ("the budget cuts the last prompt into a chunk", budget_chunks,
         "the budget runs out inside the third prompt: that request is still admitted, with only what is left of "
         "the budget scheduled (chunked prefill), while its slots are reserved for all its tokens, the chunk and "
         "the rest of the prompt that later steps run; once the budget is spent nobody else is admitted"),
        ("one token of budget left: a chunk of one", one_token_left,
         "the first prompt takes 6 of the 7 tokens of budget: the one left is still a budget, so the second request "
         "is admitted with a chunk of a single token, and only then is the budget spent"),
        ("max_num_seqs caps the running requests", seq_cap,
         "the cap counts every running request, the one running before this call included: one runs, the cap is "
         "3, so only two of the three waiting join"),
        ("a preempted request runs its prompt and its output again", preempted,
         "a request back from preemption has output tokens already: its slots and its scheduled tokens are for "
         "all of its tokens (request.tokens), not its prompt alone"),
        ("out of blocks: first come, first served, so nobody jumps the queue", out_of_blocks,
         "the request at the front does not fit in the free blocks: it stays at the front, and the requests "
         "behind it wait too, even one small enough to fit"),
        ("a cached prefix is not run again", cached_prefix,
         "8 of r0's tokens are cached already: they count as computed (num_computed), and only the rest is "
         "scheduled and taken off the budget"),
        ("a cached prefix needs no new blocks, so the request fits", prefix_makes_room,
         "r0 needs 3 blocks, only 2 are free, but 2 of its 3 are cached and need no new memory: whether a request "
         "fits is for add_sequence to say, not a count of free blocks made beforehand"),
        ("no budget left: nothing admitted", empty_budget,
         "with a budget of 0 there is nothing to schedule: no request is admitted and none is given blocks")]]


def _preempt_cases() -> list[Scenario]:
    def build(n_running: int, waiting: int) -> Callable[[], tuple[State, tuple]]:
        def state() -> tuple[State, tuple]:
            allocator = BlockAllocator(32, 4)
            running = _running(allocator, *[_request(f"run{i}", 3 + 2 * i, 10 * i, output=i) for i in range(n_running)])
            return (deque(_request(f"wait{i}", 2, 500 + i) for i in range(waiting)), running, allocator), ()
        return state

    def shared_prefix() -> tuple[State, tuple]:  # the victim shares blocks with an older request
        allocator = BlockAllocator(16, 4)
        running = _running(allocator, _request("a", 9), _request("b", 10, output=2))
        return (deque(), running, allocator), ()

    def preempted_before() -> tuple[State, tuple]:  # the victim comes back from an earlier preemption
        state, extra = build(2, 1)()
        state[1][-1].preemptions = 1
        return state, extra

    return [_scenario(label, build_state, preempt_newest, hint) for label, build_state, hint in [
        ("three running, none waiting", build(3, 0),
         "the plainest preemption, of the newest request (the last in running): the field the message names "
         "shows which part of its bookkeeping is off (what it loses of the cache: its blocks, freed through the "
         "allocator, and its computed tokens; its status, its count of preemptions; its prompt and output stay), "
         "or that it was not the one returned"),
        ("the victim goes to the front of the queue", build(3, 2),
         "requests are waiting already: the preempted one arrived before them, so it goes to the front of "
         "waiting, not the back"),
        ("the only running request", build(1, 1),
         "with one request running, that one is the newest: running is left empty"),
        ("blocks shared with an older request stay with it", shared_prefix,
         "the victim shares its prefix blocks with an older request: freeing it through the allocator drops its "
         "own hold only, and the shared blocks stay with the request still running"),
        ("a request preempted before is preempted again", preempted_before,
         "the victim was preempted once already (preemptions is 1): preemptions counts every preemption, so it "
         "goes up by one, to 2, not back to 1")]]


def _metric_cases() -> list[Case]:
    return [  # expected values worked out by hand
        Case("three tokens, completes with the last", (0.5, [1.0, 1.2, 1.5]),
             {"ttft": 0.5, "tpot": 0.25, "itl": [0.2, 0.3], "e2e": 1.0},
             hint="the definitions on the plainest request: TTFT runs from arrival to the first token, E2E to "
                  "the finish (here the last token), TPOT spreads the time after the first token over the "
                  "gaps that follow it, and itl lists those gaps"),
        Case("held after its last token (static batching)", (0.0, [0.4, 0.6, 0.8, 1.0]),
             {"ttft": 0.4, "tpot": 0.4, "itl": [0.2, 0.2, 0.2], "e2e": 1.6}, kwargs={"finish": 1.6},
             hint="finish is given, later than the last token: E2E and TPOT run to finish, while itl is still "
                  "the gaps between the tokens"),
        Case("a single token has no TPOT", (2.0, [2.25]), {"ttft": 0.25, "tpot": None, "itl": [], "e2e": 0.25},
             hint="one token has no gap after it: tpot is None (not a division by zero) and itl is empty"),
        Case("two tokens: one gap, a TPOT already", (0.0, [0.5, 0.75]),
             {"ttft": 0.5, "tpot": 0.25, "itl": [0.25], "e2e": 0.75},
             hint="two tokens have one gap between them: tpot is that gap's time over 1, and None only for a "
                  "single token"),
        Case("arrived while the engine was busy", (1.0, [4.0, 4.1, 4.3, 4.6, 5.0]),
             {"ttft": 3.0, "tpot": 0.25, "itl": [0.1, 0.2, 0.3, 0.4], "e2e": 4.0},
             hint="the request waited 3 s for its first token: the wait is all in TTFT, and TPOT counts only "
                  "the time after the first token"),
    ]


EXERCISES = [
    Exercise(
        id="ex04.1", title="One scheduling step: admit waiting requests", points=2, function="admit",
        cases=_admit_cases,
        recipe="Loop while a request waits, the budget is above 0 and fewer than max_num_seqs requests run. "
             "Reserve the slots of the front request (waiting[0]) for all its tokens: cached = "
             "allocator.add_sequence(request.request_id, request.tokens). On OutOfBlocks stop, leaving it at the "
             "front: nobody behind it is tried (first come, first served). Otherwise take it off waiting "
             "(popleft), set num_computed = cached (those tokens are computed already) and status = 'running', "
             "append it to running, schedule n = min(len(request.tokens) - cached, budget) tokens, record "
             "(request, n) and take n off the budget. Return the records.",
    ),
    Exercise(
        id="ex04.2", title="Preempt the newest request", points=2, function="preempt_newest",
        cases=_preempt_cases,
        recipe="The newest request is the last in `running`: pop it. It keeps its prompt and its output (their "
             "keys and values are computed again when it comes back); what it loses is its place in the cache: "
             "its blocks (allocator.free(its request_id)), and its num_computed (0). Its status goes back to "
             "'waiting', its preemptions go up by one, and it returns at the front of `waiting` "
             "(appendleft), not the back. Return it.",
    ),
    Exercise(
        id="ex04.3", title="TTFT, TPOT and ITL from timestamps", points=1, function="request_metrics",
        cases=_metric_cases,
        recipe="ttft = first token time - arrival; e2e = finish - arrival (finish defaults to the last token "
             "time); tpot = (e2e - ttft) / (tokens - 1), None for one token; itl = the gaps between "
             "consecutive token times.",
    ),
]
