"""Exercises of notebook 04: plausible mistakes fail, with a hint that helps."""
from __future__ import annotations

import pytest

from labkit.check import FAILED, PASSED, run_cases
from labkit.exercises import get

from exercise_cells import fails, mistake, solution


def test_lab04_plausible_mistakes_fail():
    from labkit.memory import blocks_for
    from labkit.paged import OutOfBlocks
    admit, preempt_newest, request_metrics = solution("ex04.1"), solution("ex04.2"), solution("ex04.3")

    def unlimited(waiting, running, allocator, budget, max_num_seqs):  # ignores the token budget
        return admit(waiting, running, allocator, 10**9, max_num_seqs)
    result = fails("ex04.1", unlimited, "the budget cuts the last prompt", "the budget runs out inside the third prompt")
    assert "only what is left of the budget scheduled" in result.message, result.message

    def skips_ahead(waiting, running, allocator, budget, max_num_seqs):  # a later request jumps the queue
        scheduled = []
        for request in list(waiting):
            if budget <= 0 or len(running) >= max_num_seqs:
                break
            try:
                cached = allocator.add_sequence(request.request_id, request.tokens)
            except OutOfBlocks:
                continue
            waiting.remove(request)
            request.num_computed, request.status = cached, "running"
            running.append(request)
            scheduled.append((request, min(len(request.tokens) - cached, budget)))
            budget -= scheduled[-1][1]
        return scheduled
    result = fails("ex04.1", skips_ahead, "out of blocks: first come, first served", "the requests behind it wait too")
    assert 0 < result.passed < result.total

    def admit_with(reserve, run, fits=lambda allocator, request: True, counts_scheduled=False, late_budget=False,
                   takes_off=True):
        """admit, but reserving ``reserve(request)``, scheduling ``run(request) - cached`` tokens, trying a
        request only if ``fits``, (``counts_scheduled``) counting this call's admissions twice in the cap,
        (``late_budget``) checking the budget only after giving a request its blocks, and (``takes_off``)
        taking an admitted request off waiting."""
        def wrong(waiting, running, allocator, budget, max_num_seqs):
            scheduled = []
            for request in list(waiting):
                if not (late_budget or budget > 0) or len(running) + counts_scheduled * len(scheduled) >= max_num_seqs:
                    break
                if not fits(allocator, request):
                    break
                try:
                    cached = allocator.add_sequence(request.request_id, reserve(request))
                except OutOfBlocks:
                    break
                if budget <= 0:  # reached only late: the blocks given, no budget left
                    break
                n = min(len(run(request)) - cached, budget)
                if takes_off:
                    waiting.popleft()
                request.num_computed, request.status = cached, "running"
                running.append(request)
                scheduled.append((request, n))
                budget -= n
            return scheduled
        return wrong
    tokens, prompt = (lambda r: r.tokens), (lambda r: r.prompt)
    assert run_cases(get("ex04.1"), admit_with(tokens, tokens)).status == PASSED  # the helper itself is right
    for label, wrong, case in [
            ("prompt only", admit_with(prompt, prompt), "a preempted request"),
            ("all reserved, prompt scheduled", admit_with(tokens, prompt), "a preempted request"),
            ("counts blocks before the cache", admit_with(tokens, tokens, fits=lambda a, r: a.num_free >= blocks_for(
                len(r.tokens), a.block_size)), "a cached prefix needs no new blocks"),
            ("cap counts admissions twice", admit_with(tokens, tokens, counts_scheduled=True), "max_num_seqs")]:
        result = run_cases(get("ex04.1"), wrong)
        assert result.status == FAILED and result.passed == result.total - 1 and case in result.message, label

    fails("ex04.1", admit_with(tokens, tokens, late_budget=True), "one token of budget left",
          "r2 waits but still holds blocks: a request given blocks must be admitted")  # then no budget found
    fails("ex04.1", admit_with(tokens, tokens, takes_off=False), "three prompts that all fit",
          "r0, r1, r2 are both waiting and running: take them off waiting")

    def oldest(waiting, running, allocator):
        return preempt_newest(waiting, running[::-1], allocator) and running.pop(0)
    result = fails("ex04.2", oldest, "three running", "returned should be request run2, got request run0")
    assert "of the newest request (the last in running)" in result.message, result.message

    def keeps_blocks(waiting, running, allocator):  # forgets to free: the blocks leak
        victim = running.pop()
        victim.num_computed, victim.status, victim.preemptions = 0, "waiting", victim.preemptions + 1
        waiting.appendleft(victim)
        return victim
    fails("ex04.2", keeps_blocks, "three running", "run2 waits but still holds blocks: a request sent back to "
          "waiting must give its blocks back")

    def forgets_output(waiting, running, allocator):  # the victim loses the tokens it generated
        victim = preempt_newest(waiting, running, allocator)
        victim.output = []
        return victim
    result = run_cases(get("ex04.2"), forgets_output)
    assert result.status == FAILED and "preemptions, output) should be" in result.message, result.message

    def tpot_over_all(arrival, token_times, finish=None):  # divides by n, not n - 1
        metrics = request_metrics(arrival, token_times, finish)
        if metrics["tpot"] is not None:
            metrics["tpot"] = (metrics["e2e"] - metrics["ttft"]) / len(token_times)
        return metrics
    result = run_cases(get("ex04.3"), tpot_over_all)
    assert result.status == FAILED and "'tpot': expected" in result.message, result.message  # names the key


def test_lab04_a_failing_case_shows_its_own_hint():
    from labkit.paged import OutOfBlocks
    preempt_newest, request_metrics = solution("ex04.2"), solution("ex04.3")

    def ignores_cache(waiting, running, allocator, budget, max_num_seqs):  # schedules the cached prefix again
        scheduled = []
        while waiting and budget > 0 and len(running) < max_num_seqs:
            try:
                allocator.add_sequence(waiting[0].request_id, waiting[0].tokens)
            except OutOfBlocks:
                break
            request = waiting.popleft()
            request.status = "running"
            running.append(request)
            scheduled.append((request, min(len(request.tokens), budget)))
            budget -= scheduled[-1][1]
        return scheduled
    result = run_cases(get("ex04.1"), ignores_cache)
    assert result.failed_case == "a cached prefix is not run again", result.message
    assert "count as computed" in result.message, result.message

    def to_the_back(waiting, running, allocator):  # the victim queues behind those already waiting
        victim = preempt_newest(waiting, running, allocator)
        waiting.rotate(-1)
        return victim
    result = run_cases(get("ex04.2"), to_the_back)
    assert result.failed_case == "the victim goes to the front of the queue", result.message
    assert "arrived before them" in result.message, result.message

    def divides_by_zero(arrival, token_times, finish=None):  # no special case for a single token
        metrics = request_metrics(arrival, token_times, finish)
        metrics["tpot"] = (metrics["e2e"] - metrics["ttft"]) / (len(token_times) - 1)
        return metrics
    result = run_cases(get("ex04.3"), divides_by_zero)
    assert result.failed_case == "a single token has no TPOT" and "not a division by zero" in result.message


def test_each_lab04_mistake_fails_at_the_case_that_names_it(root):
    for ex_id, right, wrong, case, hint in [
            # slots for the scheduled chunk only: the rest of the prompt has nowhere to go in later steps
            ("ex04.1", "allocator.add_sequence(request.request_id, request.tokens)",
             "allocator.add_sequence(request.request_id, request.tokens[:budget])",
             "the budget cuts the last prompt", "slots are reserved for all its tokens"),
            # sets the count instead of counting: right only for a first preemption
            ("ex04.2", "victim.preemptions += 1", "victim.preemptions = 1",
             "a request preempted before", "counts every preemption")]:
        fails(ex_id, mistake(root, ex_id, right, wrong), case, hint)


def test_off_by_ones_found_by_mutating_the_solutions_fail(root):
    fails("ex04.1", mistake(root, "ex04.1", "budget > 0 and", "budget > 1 and"), "one token of budget left",
          "the one left is still a budget")
    fails("ex04.3", mistake(root, "ex04.3", "if len(token_times) > 1", "if len(token_times) > 2"),
          "two tokens: one gap", "None only for a single token")


@pytest.mark.parametrize("ex_id, right, wrong, case, says", [
    ("ex04.2", "return victim", "return victim.request_id", "three running", "got the id 'run2', not the request"),
    ("ex04.1", "scheduled.append((request, n))", "scheduled.append((request.request_id, n))", "three prompts",
     "('r0', 5), not a (request, tokens) pair"),  # the check's own AttributeError no more
    ("ex04.1", "    return scheduled", "    return tuple(scheduled)", "three prompts", "of type tuple"),
    ("ex04.1", "budget > 0 and", "budget >= 0 and", "one token of budget left",
     "a request admitted with 0 tokens scheduled"),
])
def test_lab04_a_result_of_another_shape_is_said_so(root, ex_id, right, wrong, case, says):
    result = fails(ex_id, mistake(root, ex_id, right, wrong), case, says)
    assert "AttributeError" not in result.message, result.message


def test_gaps_in_an_array_are_right_values_of_another_type(root):
    result = fails("ex04.3", mistake(root, "ex04.3", "[b - a for a, b in zip(token_times, token_times[1:])]",
                                     "__import__('numpy').diff(token_times)"), "three tokens",
                   "'itl': the values are right, but in a NumPy array: expected a list (x.tolist())")
    assert "hint:" not in result.message
