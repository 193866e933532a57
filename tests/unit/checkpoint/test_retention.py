import os

from elastictrain.checkpoint.discovery import CheckpointInfo, list_checkpoints
from elastictrain.checkpoint.manifest import MARKER_NAME
from elastictrain.checkpoint.retention import apply_retention, plan_retention


def ck(step, status="valid"):
    return CheckpointInfo(step=step, dirname=f"step-{step:08d}", url=f"x/step-{step:08d}", status=status)


def steps(infos):
    return sorted(c.step for c in infos)


def test_keeps_the_last_n_valid_ones():
    cks = [ck(s) for s in (10, 20, 30, 40, 50)]
    assert steps(plan_retention(cks, keep_last=2)) == [10, 20, 30]


def test_keep_every_mth_step_in_addition():
    cks = [ck(s) for s in range(10, 110, 10)]
    assert steps(plan_retention(cks, keep_last=2, keep_every=40)) == [10, 20, 30, 50, 60, 70]


def test_torn_leftovers_older_than_newest_valid_are_collected_newer_ones_are_not():
    cks = [ck(10), ck(15, "torn"), ck(20), ck(25, "corrupt"), ck(30, "torn")]
    # step 30 may be a save in progress; 15 and 25 are leftovers
    assert steps(plan_retention(cks, keep_last=5)) == [15]
    assert steps(plan_retention([ck(10), ck(20), ck(15, "torn"), ck(30)], keep_last=5)) == [15]
    assert steps(plan_retention([ck(10), ck(15, "torn"), ck(20)], keep_last=5, in_flight_steps=[15])) == []


def test_the_newest_valid_one_is_never_deleted_and_nothing_while_a_save_is_in_flight():
    cks = [ck(10), ck(20, "torn"), ck(30, "corrupt")]
    assert plan_retention(cks, keep_last=0) == []  # the only valid one, however low keep_last is
    assert plan_retention([ck(s) for s in (1, 2, 3, 4)], keep_last=1, save_in_flight=True) == []
    assert plan_retention([ck(5, "torn"), ck(6, "torn")], keep_last=1) == []  # no valid one: keep all


def test_apply_retention_deletes_directories_on_storage(storage, make_checkpoint):
    for s in (1, 2, 3, 4):
        make_checkpoint(s)
    os.remove(storage.path("step-00000002", MARKER_NAME))
    deleted = apply_retention(storage, keep_last=2)
    assert [u.rsplit("/", 1)[1] for u in deleted] == ["step-00000001", "step-00000002"]
    assert [c.step for c in list_checkpoints(storage)] == [4, 3]
