"""The bookkeeping of the ending wakes a claim loop owes (dispatcher.OwedWakes): which wakes a
claim acts for, and which are left to hand on to the fleet."""

from __future__ import annotations

import time

from agentd.dispatcher import OwedWakes


def test_a_wake_no_claim_was_sent_after_is_owed_until_one_is() -> None:
    owed = OwedWakes()
    assert owed.arrive(time.monotonic(), 1) == 1
    owed.claim_sent()
    assert owed.owed == 0, "the claim acts for it"
    owed.claim_done(took=0, slots=1)
    assert owed.owed == 0, "it found nothing to claim: nothing was freed"


def test_a_claim_acts_for_one_wake_per_turn_it_took_when_it_used_every_slot() -> None:
    owed = OwedWakes()
    owed.arrive(time.monotonic(), 2)  # two endings, each may have freed a turn
    owed.claim_sent()
    owed.claim_done(took=1, slots=1)
    assert owed.owed == 1, "one slot: one of the freed turns may still be queued"
    assert owed.take() == 1 and owed.owed == 0


def test_a_claim_with_a_slot_to_spare_acts_for_every_wake() -> None:
    owed = OwedWakes()
    owed.arrive(time.monotonic(), 3)
    owed.claim_sent()
    owed.claim_done(took=2, slots=4)
    assert owed.owed == 0


def test_wakes_arriving_while_a_claim_sent_after_their_endings_is_out_are_acted_for() -> None:
    owed = OwedWakes()
    ended = time.monotonic()
    owed.claim_sent()
    assert owed.arrive(ended, 1) == 0, "the claim in flight acts for it"
    owed.claim_done(took=1, slots=1)
    assert owed.owed == 0, "the claim took a turn for it"


def test_a_failed_claim_gives_back_the_wakes_it_acted_for() -> None:
    owed = OwedWakes()
    owed.arrive(time.monotonic(), 1)
    owed.claim_sent()
    ended = time.monotonic()  # an ending committed after the claim was sent
    assert owed.arrive(ended, 1) == 1
    assert owed.claim_failed() == 1, "the wake it acted for, to hand on"
    assert owed.owed == 1, "the later one is owed as before"


def test_wakes_arriving_after_a_claim_that_covered_them_spend_its_spare_turns() -> None:
    owed = OwedWakes()
    ended = time.monotonic()
    owed.claim_sent()
    owed.claim_done(took=1, slots=1)
    assert owed.arrive(ended, 2) == 1, "the claim's one turn acts for one of the two"
    assert owed.arrive(ended, 1) == 2, "and for no more"


def test_a_failed_claim_took_nothing_to_act_with() -> None:
    owed = OwedWakes()
    owed.claim_sent()
    owed.claim_done(took=1, slots=1)  # a turn no wake was owed for
    ended = time.monotonic()
    owed.claim_sent()
    owed.claim_failed()
    assert owed.arrive(ended, 1) == 1, "not acted for by the turn of the claim before"
