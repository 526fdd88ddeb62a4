"""`python -m hcjax.bench.chaos --quick` end to end: the multi-process climb (a climb process and
two `hcjax.serve` replicas on 127.0.0.1 with a shared token) under each fault loses no accepted
rollout, rejects every bad RPC while answering a good one after each, and recovers. Weights move
by delta sync: the learner is killed inside a delta push, and a replica receives a corrupted
delta (refused, the same version installed whole, nothing half-applied served)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_chaos_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hcjax.bench.chaos", "--quick",
                           "--work_dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    faults, climb = result["faults"], result["climb"]
    assert set(faults) == {"replica_sigkill", "replica_sigstop", "bad_rpcs",
                           "learner_kill_in_transfer", "corrupt_checkpoint"}
    # Every fault first (a fault's error says why the climb stopped), then the climb's end.
    for name, f in faults.items():
        assert "error" not in f, (name, f)
    assert "error" not in climb, climb
    for name, f in faults.items():
        assert f["kept_stepping"], (name, f)
        assert f["accepted_rollouts_missing_after"] == 0, (name, f)
    # Every accepted group in the store was trained on or is still buffered at the end.
    assert climb["climb_exit_code"] == 0 and climb["accepted_rollouts_lost"] == 0, climb
    assert climb["store_accepted_groups"] > 0
    # Delta sync happened: each replica installed deltas as well as full pushes.
    for pushes in climb["weight_pushes"].values():
        assert pushes["installed"].get("delta", 0) > 0 and pushes["installed"].get("full", 0) > 0

    kill = faults["replica_sigkill"]
    assert kill["recover_next_learner_step_s"] is not None
    assert kill["readmitted_with_version"] is not None and kill["readmitted_with_version"] >= 0

    stop = faults["replica_sigstop"]
    # The stopped replica is left out of weight pushes: the learner steps on while it is stopped.
    assert stop["learner_steps_during_stop"] > 0
    assert stop["cont_to_taking_requests_s"] is not None

    bad = faults["bad_rpcs"]
    assert bad["rejected"] == bad["sent"] > 0
    assert set(bad["status_codes"]) == {"UNAUTHENTICATED", "INVALID_ARGUMENT"}
    assert bad["good_request_succeeded_after_each"] and bad["replica_serving_after"]
    # Meanwhile replica b got a delta with a byte flipped: it answered DATA_LOSS (the learner's
    # log says so), went on serving its previous version, installed that version once, from the
    # full push that followed, then held the same weights as replica a and kept generating.
    cd = bad["corrupted_delta"]
    assert cd["answered_data_loss"] and cd["refused"].startswith("ChecksumMismatch"), cd
    assert cd["installs_of_version"] == ["full"] and cd["never_served_half_applied"], cd
    assert cd["base"] is not None and cd["version_reported_before"] < cd["version"], cd
    assert all(v < cd["version"] for v in cd["reported_versions_while_refused"]), cd
    assert cd["same_weights_as_other_replica"]["equal"], cd
    assert cd["learner_steps_after"] > 0 and cd["groups_after"] > 0, cd
    assert cd["good_request_after"], cd

    learner = faults["learner_kill_in_transfer"]
    assert learner["restarted"] and learner["during_failed_transfer"]["keeps_serving_old_version"]
    # The push the kill interrupted was a delta; the replica's pull of it failed and installed
    # nothing; the restarted learner (no base) pushed that replica a full version first.
    cut = learner["interrupted_push"]
    assert cut["mode"] == "delta" and cut["version"] == learner["new_version"], cut
    assert [(f["version"], f["mode"]) for f in cut["pull_failed"]] == [(cut["version"], "delta")]
    assert learner["first_push_after_restart"]["mode"] == "full", learner
    assert learner["resumed_from_step"] < learner["after_step"]
    assert learner["replicas_dropped_after_restart"] == []
    # The restarted learner redoes the steps the killed one logged after its last checkpoint, on
    # the same accepted groups from the store: bit for bit the same step.
    redone = learner["next_step_equals_uninterrupted"]
    assert redone["compared_steps"] and redone["equal"], redone

    corrupt = faults["corrupt_checkpoint"]
    assert corrupt["restarted"] and corrupt["fell_back_to_previous"]
    assert corrupt["warning_names_bad_step"] and corrupt["set_aside"]
