"""connector/vllm/waits.py: a key's wait is bounded from the first lookup that waited on it;
a key no tier holds is not asked again for ``ttl_steps``."""

from __future__ import annotations

from collections import Counter

import pytest
from kvoffload.connector.vllm import waits
from kvoffload.connector.vllm.waits import Finds, Waits

A, B = b"a" * 16, b"b" * 16


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    now = [100.0]
    monkeypatch.setattr(waits.time, "monotonic", lambda: now[0])
    return now


def test_a_key_waits_the_bound_from_its_first_wait_then_gives_up(clock: list[float]) -> None:
    w = Waits(250, Counter())
    w.start_step(1, [A, B], [])
    assert w.may_wait(A)
    clock[0] += 0.2
    w.start_step(2, [A, B], [])
    assert w.may_wait(A) and w.may_wait(B)  # B's clock starts now
    clock[0] += 0.1
    w.start_step(3, [A, B], [])
    assert not w.may_wait(A) and w.may_wait(B)
    assert w.counters["waits_given_up"] == 1


def test_the_clock_is_read_once_a_step(clock: list[float]) -> None:
    w = Waits(250, Counter())
    w.start_step(1, [A], [])
    assert w.may_wait(A)
    clock[0] += 10  # within one step every lookup answers alike
    assert w.may_wait(A)


def test_prune_forgets_keys_no_longer_waited_on(clock: list[float]) -> None:
    w = Waits(250, Counter())
    w.start_step(1, [A, B], [])
    assert w.may_wait(A) and w.may_wait(B)
    clock[0] += 1
    w.start_step(waits.PRUNE_STEPS, [B], [])  # A is READY (or gone) now: a fresh wait later
    assert w.may_wait(A) and not w.may_wait(B)


def test_finds_ask_once_and_respect_the_ttl() -> None:
    f = Finds(ttl_steps=4)
    assert f.worth_asking(A, 0) and f.ask(A) and not f.ask(A)
    f.answered([], [A], 10)
    assert not f.worth_asking(A, 14) and f.worth_asking(A, 15)
    assert f.ask(A)
    f.answered([A], [], 16)
    assert A not in f.asking


def test_a_key_we_store_is_asked_of_the_tiers_again() -> None:
    """No tier had it; then this engine stored it: once the pool evicts it a tier may hold
    it, so the next lookup asks again rather than trust the old answer for ``ttl_steps``."""
    f = Finds(64)
    assert f.ask(A) and f.ask(B)
    f.answered([], [A, B], step=10)
    assert not f.worth_asking(A, 20) and not f.worth_asking(B, 20)
    f.stored([A])
    assert f.worth_asking(A, 20) and not f.worth_asking(B, 20)
