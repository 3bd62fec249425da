"""benchmarks/reproduce_paper.py: the stored fits are the shipped profile's, every point has a
leave-one-out prediction, the JSON output has the agreed shape, and the stored planner result
is what the model says (re-evaluated here).

These tests guard the bookkeeping, not the model's accuracy: the residuals (in-sample and
leave-one-out) are reported by the script and in docs/performance_model.md.
"""

import importlib.util
import json
import math
import pathlib

import pytest

from megatron.performance_model import GPT2_PAPER, P100_ARIES, evaluate, paper

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce_paper.py"


@pytest.fixture(scope="module")
def reproduce():
    spec = importlib.util.spec_from_file_location("reproduce_paper", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fits(reproduce):
    return reproduce.load_fits()


def test_shipped_profile_is_the_in_sample_fit(reproduce, fits):
    shipped = reproduce.constants_of(P100_ARIES)
    for name in reproduce.FITTED:
        assert shipped[name] == pytest.approx(fits["in_sample"][name], rel=5e-3)
    assert len(reproduce.FITTED) <= 3


def test_stored_error_is_the_error_of_the_stored_constants(reproduce, fits):
    values = reproduce.residuals({name: fits["in_sample"][name] for name in reproduce.FITTED},
                                 reproduce.FIT_POINTS)
    rms = math.sqrt(sum(v * v for v in values) / len(values))
    assert rms == pytest.approx(fits["in_sample"]["rms_log_error"], rel=1e-3)


def test_every_point_has_its_own_leave_one_out_fit(reproduce, fits):
    labels = [run.label for run in reproduce.FIT_POINTS]
    assert len(set(labels)) == len(labels) == 11
    assert set(fits["leave_one_out"]) == set(labels)
    assert set(fits["leave_pair_out"]) == set(paper.PUBLISHED_SPEEDUPS)
    assert set(fits["weak_scaling_held_out"]) == set(reproduce.WEAK_SCALING_HELD_OUT)
    # Leaving a point out changes the constants (the fit did not see it).
    assert any(fits["leave_one_out"][label]["efficiency"] != fits["in_sample"]["efficiency"]
               for label in labels)


def test_weak_scaling_is_held_out_like_a_speedup(reproduce, fits):
    """The efficiency divides two measurements, so its held-out value comes from one fit that
    saw neither (the 512-node W=16 D=32 row and the 2,048-node Chimera row; the wider one
    also not the 1,024-node row), and each of those fits really left them out."""
    held_out = reproduce.WEAK_SCALING_HELD_OUT
    assert set(held_out["end points"]) == {"W=16 D=32", "Chimera"}
    assert set(held_out["all three"]) == {"W=16 D=32", "1,024 nodes", "Chimera"}
    assert paper.WEAK_SCALING[0].nodes == 512 and paper.WEAK_SCALING[2].nodes == 2048
    labels = {run.label for run in reproduce.FIT_POINTS}
    for name, left_out in held_out.items():
        assert set(left_out) <= labels
        rest = tuple(r for r in reproduce.FIT_POINTS if r.label not in left_out)
        values = reproduce.residuals(
            {key: fits["weak_scaling_held_out"][name][key] for key in reproduce.FITTED}, rest)
        rms = math.sqrt(sum(v * v for v in values) / len(values))
        assert rms == pytest.approx(fits["weak_scaling_held_out"][name]["rms_log_error"],
                                    rel=1e-3)
    efficiency = reproduce.weak_scaling_efficiency(fits)
    one_fit = reproduce.hardware_of(fits["weak_scaling_held_out"]["end points"])
    assert efficiency["leave_one_out"] == pytest.approx(
        reproduce.predict(one_fit, paper.WEAK_SCALING[2])
        / (4 * reproduce.predict(one_fit, paper.WEAK_SCALING[0])), rel=1e-12)
    assert efficiency["per_point_leave_one_out"] != efficiency["leave_one_out"]


def test_stored_planner_result_is_reproduced_and_beats_the_papers_choice(fits):
    top = fits["planner"][0]
    again = evaluate(GPT2_PAPER, P100_ARIES, top["scheme"], top["W"], top["D"], top["B"],
                     top["N"], top["recompute"], stage_balance="per-stage")
    assert again.fits and again.throughput == pytest.approx(top["seq_per_s"], rel=5e-3)
    papers = evaluate(GPT2_PAPER, P100_ARIES, "chimera-direct", 64, 32, 1, 32, "none",
                      stage_balance="per-stage")
    assert papers.throughput <= top["seq_per_s"] * (1 + 1e-9)
    assert [r["seq_per_s"] for r in fits["planner"]] == sorted(
        (r["seq_per_s"] for r in fits["planner"]), reverse=True)


def test_json_output_has_the_agreed_shape(reproduce, capsys):
    assert reproduce.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["speedups"]) == set(paper.PUBLISHED_SPEEDUPS)
    for name, value in data["speedups"].items():
        assert value["published"] == paper.PUBLISHED_SPEEDUPS[name]
        assert value["predicted"] > 0 and value["leave_one_out"] > 0
    assert {"scheme", "W", "D"} <= set(data["planner_top"])
    assert data["weak_scaling_efficiency"]["published"] == 0.914
    assert {"in_sample", "leave_one_out", "without_any_weak_scaling_point",
            "per_point_leave_one_out"} <= set(data["weak_scaling_efficiency"])
    assert len(data["points"]) == 11
    assert all(row["fits_memory"] for row in data["points"])
    # Bert-48 Chimera (never fitted): transcribed from chimera.md §8, predicted by two fits
    assert [(r["nodes"], r["published"]) for r in data["bert48_chimera"]] == [
        (16, 89), (32, 174), (64, 341)]
    assert all(r["in_sample"] > 0 and r["without_pipedream_2bw"] > 0
               for r in data["bert48_chimera"])
    # Bert-48 at 64 nodes, Chimera over PipeDream-2BW (never fitted): transcribed 1.17x
    bert_2bw = data["bert48_pipedream_2bw"]
    assert bert_2bw["published"] == paper.BERT48_SPEEDUP_OVER_PIPEDREAM_2BW_64 == 1.17
    assert all(bert_2bw[key] > 0 for key in ("in_sample", "without_pipedream_2bw",
                                              "at_injection_bound", "unlimited_bandwidth"))


def test_every_stored_fit_stays_inside_what_the_hardware_allows(reproduce, fits):
    """Sustained FLOP rate at most the P100's peak, per-node bandwidth at most the Aries NIC's
    stated injection bandwidth, γ a fraction in (0, 1]: in-sample and every held-out fit."""
    from megatron.performance_model.specs import ARIES_INJECTION_BANDWIDTH

    box = reproduce.bounds()
    assert box["bandwidth"][1] == ARIES_INJECTION_BANDWIDTH == pytest.approx(10.2e9)
    assert box["efficiency"][1] == 1.0 and box["global_bandwidth_fraction"][1] == 1.0
    every = [fits["in_sample"], *fits["leave_one_out"].values(),
             *fits["leave_pair_out"].values(), *fits["weak_scaling_held_out"].values()]
    for constants in every:
        for name in reproduce.FITTED:
            low, high = box[name]
            assert 0 < low <= constants[name] <= high * (1 + 1e-9), (name, constants)


def test_bounded_fit_holds_a_constant_at_its_bound_and_fits_the_rest(reproduce, monkeypatch):
    """A stand-in residual whose unbounded optimum lies past the bandwidth bound along a flat
    direction (only bandwidth × γ is pinned, with a weak pull towards 1,000 GB/s): the fit
    stops at the bound and sets γ so that the product is kept."""
    import math

    high = reproduce.bounds()["bandwidth"][1]

    def stand_in(constants, points, base=None, memo=None):
        return [math.log(constants["bandwidth"] * constants["global_bandwidth_fraction"] / 1e9),
                math.log(constants["efficiency"] / 0.4),
                0.01 * math.log(constants["bandwidth"] / 1e12)]

    monkeypatch.setattr(reproduce, "residuals", stand_in)
    start = {"efficiency": 0.3, "bandwidth": 5e9, "global_bandwidth_fraction": 0.2}
    result = reproduce.fit(("one", "two", "three"), start, iterations=60)
    assert result["bandwidth"] == pytest.approx(high)
    assert result["global_bandwidth_fraction"] == pytest.approx(1e9 / high, rel=1e-3)
    assert result["efficiency"] == pytest.approx(0.4, rel=1e-3)
    assert result["at_bound"] == ["bandwidth"]
