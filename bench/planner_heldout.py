"""The planner's time model on runs it was fitted on and on runs it never saw (issue 27).

    PYTHONPATH=. python bench/planner_heldout.py [--no-cv] [--no-search]

Prints, for every row of labkit/data/published_runs.json: the published tokens/s per GPU (converted with the
model's FLOP count where the source publishes a utilization or TFLOPS, which are shown too), the prediction and
the error; then a leave-one-source-out cross-validation: the constants refitted without each source, and that
source's errors. Rows whose `uncertain` field quotes the source on why its layout or hardware is too uncertain
are predicted and shown, but not counted; a counted row missed by more than 20 % prints the reason its row
records (`miss`). Last, the best-layout search (`labkit plan` with each row's model, GPUs, batch, sequence and
software): where it ranks the layouts of NVIDIA's tuned recipes (NeMo 24.07, Megatron-Bridge 25.11), and the
layouts Narayanan et al. 2021 compared head to head (PTD-P against ZeRO-3 on the same GPUs and batch). Pure
Python, ~1 minute on one core.
"""
from __future__ import annotations

import argparse
import math
import tempfile
import time

from labkit.parallel import calibration, hardware, published_runs


def _row(e: dict) -> str:
    flops = (f"{e['published_tflops']:>5.0f} {e['tflops_per_gpu']:>5.0f}" if "published_tflops" in e else f"{'':>5} {'':>5}")
    mark = "" if e["counts"] else "  not counted (uncertain)"
    return (f"  {e['id']:<38} {e['gpu']:<9} {e['gpus']:>6} {e['tp']:>2} {e['pp']:>3} {e['dp']:>5} {e['zero']:>1} "
            f"{e['published_tps']:>9.1f} {e['predicted_tps']:>9.1f} {flops} {e['rel_err']:>+6.1%}{mark}")


HEAD = (f"  {'run':<38} {'gpu':<9} {'GPUs':>6} {'t':>2} {'p':>3} {'d':>5} {'z':>1} {'pub tok/s':>9} {'model':>9} "
        f"{'pubTF':>5} {'modTF':>5} {'error':>6}")


def _summary(label: str, errs: list[dict]) -> str:
    s = calibration.summary(errs)
    if not s["rows"]:
        return f"{label}: no counted rows"
    return (f"{label}: {s['within_20']}/{s['rows']} counted rows within 20 %, median |error| {s['median']:.1%}, "
            f"worst {s['worst']:.1%}")


def _why(errs: list[dict], rows) -> None:
    """Each counted row missed by more than 20 %, with the reason its JSON row gives (`miss`)."""
    why = {r.id: r.miss or "no reason recorded in the JSON" for r in rows}
    missed = [e for e in errs if e["counts"] and abs(e["rel_err"]) > 0.2]
    for reason in dict.fromkeys(why[e["id"]] for e in missed):
        ids = ", ".join(f"{e['id']} ({e['rel_err']:+.1%})" for e in missed if why[e["id"]] == reason)
        print(f"  MISSED {ids}:\n    {reason}")


def search(rows) -> None:
    """Where `labkit plan` ranks each recipe's layout, and each compared layout, among the layouts that fit:
    among the ZeRO stages the row's software has (`published_runs.ZERO_STAGES`: Megatron-Core has no ZeRO-2),
    and the count again with every stage offered."""
    print("\nbest-layout search: rank of the published layout among the layouts that fit (fastest first; the ZeRO "
          "stages of the row's software)")
    with tempfile.TemporaryDirectory() as folder:
        verdicts = published_runs.search_verdicts(rows, folder)
        every = published_runs.search_verdicts(rows, folder, software=False)
    for s, e in zip(verdicts, every):
        where = f"rank {s['rank']}/{s['layouts']}" if s["rank"] else f"NOT AMONG THE FITS ({s['dropped']})"
        print(f"  {s['id']:<26} {where:<14} {s['published']}; first: {s['top'][0]}"
              + "".join(f"; compared {k}: rank {v}" for k, v in s["compared"].items())
              + f"  [every ZeRO stage: rank {e['rank']}]")
    print(f"published best within the search's top 3 (recipes) or above the layouts compared with it: "
          f"{sum(s['ok'] for s in verdicts)}/{len(verdicts)} (with every ZeRO stage offered, ZeRO-2 included: "
          f"{sum(e['ok'] for e in every)}/{len(every)})")


def scaling(errs: list[dict]) -> None:
    """Does the model's error grow with the GPU count (issue 42: "nothing slows a step as data parallelism
    grows")? The least-squares slope of log(predicted / published) on sqrt(2 ln N), N the GPUs: a straggler
    term max-of-N over a per-GPU step jitter sigma would remove a slope of sigma (E[max of N normals] ~
    sigma sqrt(2 ln N)). Fitted on the calibration rows, judged on the held-out ones."""
    slope = calibration.gpu_count_slope
    counted = [e for e in errs if e["counts"]]
    cal = [e for e in counted if e["status"] == "calibration"]
    held = [e for e in counted if e["status"] == "held_out"]
    explained = [e for e in held if abs(e["rel_err"]) <= 0.2]
    s = slope(cal)
    print(f"\nerror vs GPU count: slope of log(pred / pub) on sqrt(2 ln N) -- calibration {s:+.4f} "
          f"(a per-GPU jitter sigma of {s:.1%}: {s * (math.sqrt(2 * math.log(8192)) - math.sqrt(2 * math.log(256))):.1%} "
          f"from 256 to 8192 GPUs); held-out {slope(held):+.4f}, held-out within 20 % {slope(explained):+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-cv", action="store_true", help="skip the leave-one-source-out cross-validation")
    parser.add_argument("--no-search", action="store_true", help="skip the best-layout search")
    args = parser.parse_args()
    t0 = time.perf_counter()
    rows = published_runs.runs()
    print("constants in labkit.parallel.hardware.CONSTANTS:", hardware.CONSTANTS)
    refit = calibration.fit()
    print("refitted on the calibration rows:          ", refit)
    errs = calibration.errors(rows, hardware.CONSTANTS)
    for status in ("held_out", "calibration"):
        part = [e for e in errs if e["status"] == status]
        print(f"\n{status} rows ({len(part)}): published vs predicted tokens/s per GPU (TFLOPS where published)")
        print(HEAD)
        for e in part:
            print(_row(e))
        print(_summary(status, part))
        _why(part, rows)
    scaling(errs)
    if not args.no_cv:
        print("\nleave-one-source-out: refit without the source, predict all its rows")
        cv = calibration.leave_one_source_out(rows)
        for source in sorted({e["source"] for e in cv}):
            part = [e for e in cv if e["source"] == source]
            c = part[0]["constants"]
            fitted = ", ".join(f"{k.split('.', 1)[-1] if k.startswith('matmul') else k}={v:.3f}" for k, v in c.items())
            unfit = f"; no rows left to fit {', '.join(part[0]['unfitted'])} (the A100 value used)" if part[0]["unfitted"] else ""
            print(f" without {source}: {fitted}{unfit}")
            for e in part:
                print(_row(e))
        print(_summary("leave-one-source-out, all rows", cv))
        print(_summary("leave-one-source-out, held-out rows", [e for e in cv if e["status"] == "held_out"]))
        print(_summary("leave-one-source-out, calibration rows", [e for e in cv if e["status"] == "calibration"]))
        _why(cv, rows)
    if not args.no_search:
        search(rows)
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
