"""FSDP2's ``reshard_after_forward`` per unit, derived from the recorded trace (issue 10).

The view of a trace recorded with every unit resharding, with some units set not to
reshard (:func:`taichi_plan.reshard.reshard_view`), equals a recording made with that
setting, table by table: every tensor row, every access, every op (the ``module`` label of
backward ops excepted: ModTracker's labels there differed between two recordings of the same
setting here, e.g. an embedding's backward filed under its neighbour).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from taichi_plan.errors import PlanError
from taichi_plan.reshard import regather_ops, reshard_units, reshard_view, view_of_choice
from taichi_plan.trace import read_trace

RECORD = """
import json, sys
from taichi_plan.record import get_workload
from taichi_plan.record.fsdp import record_fsdp_workload
from taichi_plan.trace import write_trace
w = get_workload(model="gpt2", layers=2, hidden=64, heads=4, vocab=500, seq=128, batch=4)
for out, setting in json.loads(sys.argv[1]):
    write_trace(record_fsdp_workload(w, 2, reshard_after_forward=setting, check_tracker=False), out)
"""

# FSDP2's own default leaves the root gathered (fully_shard's reshard_after_forward=None);
# the last block is the usual hand-set choice (backward gathers it again at once).
SETTINGS = {"all": {}, "root+last": {"": False, "transformer.h.1": False},
            "none": {"": False, "transformer.h.0": False, "transformer.h.1": False}}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    jobs = [[str(d / name), setting] for name, setting in SETTINGS.items()]
    r = subprocess.run([sys.executable, "-c", RECORD, json.dumps(jobs)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return {name: read_trace(d / name) for name in SETTINGS}


def _differences(view, rec) -> list:
    out = []
    for name in ("ops", "tensors", "accesses"):
        x, y = getattr(view, name), getattr(rec, name)
        if x.shape != y.shape:
            out.append((name, x.shape, y.shape))
            continue
        for c in x.columns:
            if c == "shape":
                d = np.asarray([list(p) != list(q) for p, q in zip(x[c], y[c], strict=True)], dtype=bool)
            else:
                d = x[c].to_numpy() != y[c].to_numpy()
            if name == "ops" and c == "module":
                d &= x["phase"].to_numpy() != "backward"
            if d.any():
                out.append((name, c, int(d.sum()), np.nonzero(d)[0][:5].tolist()))
    for key in ("units", "op_spans", "incarnations"):
        if view.meta["fsdp"][key] != rec.meta["fsdp"][key]:
            out.append(("meta.fsdp", key))
    if view.meta["model_calls"] != rec.meta["model_calls"]:
        out.append(("meta", "model_calls"))
    return out


@pytest.mark.parametrize("name", ["root+last", "none"])
def test_view_equals_a_recording_with_that_setting(recordings, name):
    base = recordings["all"]
    view = view_of_choice(base, SETTINGS[name])
    rec = recordings[name]
    assert _differences(view, rec) == []
    assert len(view.ops) < len(base.ops)  # the backward gatherings are gone
    assert view.meta["fsdp"]["units"] == rec.meta["fsdp"]["units"]
    # the ops removed are FSDP's own (inside its spans), all in backward, with one all-gather per unit
    units = [k for k, u in enumerate(base.meta["fsdp"]["units"]) if u["module"] in SETTINGS[name]]
    gone = regather_ops(base, units)
    assert set(base.ops["phase"][gone]) == {"backward"}
    assert sum(base.ops["op"][gone].str.startswith("c10d._allgather_base_")) == len(units)


def test_a_unit_recorded_without_resharding_cannot_be_turned(recordings):
    none = recordings["none"]
    assert reshard_units(none.meta) == []
    with pytest.raises(PlanError, match="recorded not resharding"):
        reshard_view(none, [1])
    with pytest.raises(PlanError, match="does not have"):
        view_of_choice(recordings["all"], {"transformer.h.9": False})
