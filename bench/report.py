"""Tables, Pareto plots and the summary of :mod:`bench.run`'s results.

    python -m bench.report [--out bench/results]     # rebuild every .md/.png and SUMMARY.md from the JSON files

Dominance: a ckptc point Q dominates another alternative's point P when Q's
measured peak is at most P's (within ``PEAK_TOL``) and its recompute share is
at most P's (within ``RECOMPUTE_TOL`` percentage points), counted with
FlopCounterMode's formulas or, for a point not dominated on those, counting
every op's FLOPs where the run measured both that way and Q's step is no slower
(FlopCounterMode counts pointwise ops as 0, so recomputing only those looks free).  Only points that ran
and whose loss and gradients equal eager's count; ckptc's curve is every such
ckptc point (all solvers and strategies).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

PEAK_TOL = 0.01  # measured peaks within 1% count as equal
RECOMPUTE_TOL = 0.5  # percentage points of eager's step FLOPs
MiB = 2**20

CKPTC_FAMILIES = ("ckptc", "ckptc_strategy")
FAMILY_NAMES = {
    "eager": "eager",
    "ckpt_every": "checkpoint every block",
    "ckpt_every_other": "checkpoint every other block",
    "library_ckpt": "library checkpointing",
    "aot_eager": "aot_eager + activation_memory_budget",
    "ckptc": "ckptc",
    "ckptc_strategy": "ckptc strategy",
}


def mib(n: Any) -> str:
    return "-" if n is None else f"{n / MiB:.1f}"


def pct(x: Any, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ok(p: dict[str, Any]) -> bool:
    return p.get("status") == "ok" and p.get("peak_bytes") is not None


def _valid(p: dict[str, Any]) -> bool:
    return _ok(p) and bool(p.get("matches_eager"))


# --------------------------------------------------------------------------- #
# Per-model table                                                              #
# --------------------------------------------------------------------------- #


def model_markdown(result: dict[str, Any]) -> str:
    name = result["model"]
    eager = result.get("eager", {})
    probe = result.get("probe", {})
    lines = [f"# {name} ({result.get('size')}): ckptc vs alternatives", ""]
    machine = result.get("machine", {})
    lines.append(
        f"Inputs {result.get('input_shapes')}, {result.get('parameters', 0) / 1e6:.2f} M parameters, "
        f"torch {result.get('torch')}, {machine.get('threads')} threads; "
        f"load average {machine.get('load_avg_start')} -> {machine.get('load_avg_end')}."
    )
    if eager:
        lines.append(
            f"Eager: measured peak {mib(eager.get('peak_bytes'))} MiB "
            f"(resident {mib(eager.get('baseline_bytes'))} MiB), "
            f"{eager.get('flops', 0) / 1e9:.2f} GFLOP per step (FlopCounterMode formulas)."
        )
    if probe.get("status") == "ok":
        lines.append(
            f"ckptc capture: {probe['graphs']} graph(s), "
            f"predicted unoptimized peak {mib(probe['unoptimized_peak_bytes'])} MiB, "
            f"smallest feasible (ckptc's floor) {mib(probe['min_feasible_bytes'])} MiB."
        )
    elif probe:
        lines.append(f"ckptc capture failed: {probe.get('error')}")
    if result.get("status") == "error":
        lines.append(f"\n**Model failed:** {result.get('error')}")
    lines += [
        "",
        "| alternative | status | peak MiB | peak vs eager | recompute % | recompute % every op "
        "| ckptc predicted peak MiB / recompute % | step time x eager | first step s (solve s) | = eager |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    eager_peak = eager.get("peak_bytes")
    for p in result.get("points", []):
        status = p["status"]
        if _ok(p):
            vs = f"{100 * (p['peak_bytes'] / eager_peak - 1):+.1f}%" if eager_peak else "-"
            pred = (
                f"{mib(p.get('predicted_peak_bytes'))} / {pct(p.get('predicted_recompute_pct'))}"
                if p.get("predicted_peak_bytes") is not None
                else "-"
            )
            first = pct(p.get("first_step_s"))
            if p.get("solve_s") is not None:
                first += f" ({p['solve_s']:.2f})"
            diff = p.get("grad_max_abs_diff", float("nan"))
            match = "yes" if p.get("matches_eager") else f"**no** (max grad diff {diff:.2g})"
            note = f" = {p['same_plan_as']}" if p.get("same_plan_as") else ""
            if p.get("within_budget") is False:
                note += " **over budget**"
            lines.append(
                f"| {p['label']} | ok{note} | {mib(p['peak_bytes'])} | {vs} | {pct(p.get('recompute_pct'))} "
                f"| {pct(p.get(EVERY_OP))} "
                f"| {pred} | {pct(p.get('time_ratio'), 2)} | {first} | {match} |"
            )
        else:
            why = (p.get("reason") or p.get("error") or "").replace("|", "/").replace("\n", " ")[:160]
            lines.append(f"| {p['label']} | {status}: {why} | - | - | - | - | - | - | - | - |")
    lines += [
        "",
        "recompute % = (FLOPs of the step - eager's) / eager's, counted with torch.utils.flop_counter's "
        "formulas (matmul, convolution, attention, FFT ops; pointwise ops count 0); every op: the same "
        "formulas and every other op priced by the elements it reads and writes (ckptc's cost model), '-' "
        "where the run predates that count. "
        "ckptc's predicted recompute % uses its own cost model (all ops). "
        "'= X': the solver returned the same plan as X, measured once. "
        "Step time: median of interleaved repetitions against eager in the same run.",
        "",
    ]
    for note in result.get("notes", []):
        lines.append(f"* {note}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- #
# Pareto plot                                                                  #
# --------------------------------------------------------------------------- #


def pareto_plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:  # noqa: BLE001 - no matplotlib: no plot
        return False
    points = [p for p in result.get("points", []) if _ok(p)]
    if not points:
        return False
    fig, ax = plt.subplots(figsize=(8, 5.5))
    styles = {
        "eager": dict(marker="*", s=160, color="black"),
        "ckpt_every": dict(marker="s", s=70, color="tab:red"),
        "ckpt_every_other": dict(marker="D", s=60, color="tab:orange"),
        "library_ckpt": dict(marker="P", s=80, color="tab:brown"),
    }
    solver_colors = {
        "chen_sqrt": "tab:gray",
        "chen_greedy": "tab:olive",
        "hierarchical": "tab:blue",
        "ilp": "tab:purple",
        "auto": "tab:green",
    }
    strategy_markers = {"layer": "^", "segment": "v", "selective": "<"}

    def xy(ps: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
        return [p["recompute_pct"] for p in ps], [p["peak_bytes"] / MiB for p in ps]

    def hollow_wrong(ps: list[dict[str, Any]]) -> None:
        bad = [p for p in ps if not p.get("matches_eager")]
        if bad:
            x, y = xy(bad)
            ax.scatter(x, y, marker="x", s=90, color="red", zorder=5)

    for fam, style in styles.items():
        ps = [p for p in points if p["family"] == fam]
        if ps:
            x, y = xy(ps)
            ax.scatter(x, y, label=FAMILY_NAMES[fam], zorder=4, **style)
            hollow_wrong(ps)
    aot = sorted([p for p in points if p["family"] == "aot_eager"], key=lambda p: p["budget_fraction"])
    if aot:
        x, y = xy(aot)
        ax.plot(x, y, "o--", color="tab:cyan", label="aot_eager (activation_memory_budget)", zorder=3)
        for p in aot:
            ax.annotate(
                f"{p['budget_fraction']:g}",
                (p["recompute_pct"], p["peak_bytes"] / MiB),
                fontsize=7,
                xytext=(3, 3),
                textcoords="offset points",
                color="tab:cyan",
            )
        hollow_wrong(aot)
    for solver, color in solver_colors.items():
        ps = sorted(
            [p for p in points if p["family"] == "ckptc" and p.get("solver") == solver], key=lambda p: p["peak_bytes"]
        )
        if ps:
            x, y = xy(ps)
            ax.plot(x, y, "o-", color=color, alpha=0.8, ms=5, label=f"ckptc {solver}", zorder=3)
            hollow_wrong(ps)
    for strat, marker in strategy_markers.items():
        ps = [p for p in points if p["family"] == "ckptc_strategy" and p.get("strategy") == strat]
        if ps:
            x, y = xy(ps)
            ax.scatter(
                x, y, marker=marker, s=70, color="tab:green", edgecolor="black", label=f"ckptc {strat}", zorder=4
            )
            hollow_wrong(ps)
    eager_peak = result.get("eager", {}).get("peak_bytes")
    if eager_peak:
        ax.axhline(eager_peak / MiB, color="black", lw=0.6, ls=":")
    ax.set_xlabel("recompute FLOPs, % of eager step (FlopCounterMode)")
    ax.set_ylabel("measured peak memory of the step (MiB)")
    ax.set_title(
        f"{result['model']} ({result.get('size')}): peak memory vs recompute "
        "(lower-left is better; x = gradients differ)"
    )
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_model(out: Path, result: dict[str, Any]) -> None:
    name = result["model"]
    (out / f"{name}.md").write_text(model_markdown(result))
    pareto_plot(result, out / f"{name}_pareto.png")


# --------------------------------------------------------------------------- #
# Dominance and summary                                                        #
# --------------------------------------------------------------------------- #


EVERY_OP = "recompute_pct_every_op"


def dominates(q: dict[str, Any], p: dict[str, Any], metric: str = "recompute_pct") -> bool:
    """Whether ckptc's point ``q`` has at most ``p``'s peak and at most its recompute on ``metric``
    (FlopCounterMode's formulas, or :data:`EVERY_OP`: every op's FLOPs, where both were measured)."""
    mine, theirs = q.get(metric), p.get(metric)
    if mine is None or theirs is None:
        return False
    return q["peak_bytes"] <= p["peak_bytes"] * (1 + PEAK_TOL) and mine <= theirs + RECOMPUTE_TOL


def _no_slower(q: dict[str, Any], p: dict[str, Any]) -> bool:
    """Whether ``q``'s step time (against eager, in the same run) is at most ``p``'s; unknown: no."""
    mine, theirs = q.get("time_ratio"), p.get("time_ratio")
    return mine is not None and theirs is not None and mine <= theirs


def explain(p: dict[str, Any], ckptc_points: list[dict[str, Any]]) -> str:
    """One line: why no ckptc point dominates ``p`` (facts from the run)."""
    if not ckptc_points:
        return "no ckptc point ran with gradients equal to eager's"
    within = [q for q in ckptc_points if q["peak_bytes"] <= p["peak_bytes"] * (1 + PEAK_TOL)]
    lowest = min(ckptc_points, key=lambda q: q["peak_bytes"])
    if not within:
        gap = lowest["peak_bytes"] / p["peak_bytes"] - 1
        why = (
            f"its peak {mib(p['peak_bytes'])} MiB is below every ckptc point: ckptc's lowest is "
            f"{mib(lowest['peak_bytes'])} MiB ({gap:+.1%}, {lowest['label']}"
        )
        pred = lowest.get("predicted_peak_bytes")
        if pred:
            why += f", predicted {mib(pred)} MiB"
        why += ")"
        under = pred and lowest["peak_bytes"] > pred * 1.03
        if under:
            why += "; ckptc's memory model under-predicts that plan's measured peak"
        elif p["recompute_pct"] > lowest["recompute_pct"] + RECOMPUTE_TOL:
            why += f"; it pays {p['recompute_pct']:.1f}% recompute for it vs ckptc's {lowest['recompute_pct']:.1f}%"
        return why
    best = min(within, key=lambda q: q["recompute_pct"])
    why = (
        f"at <= {mib(p['peak_bytes'])} MiB ckptc's cheapest point recomputes {best['recompute_pct']:.1f}% "
        f"({best['label']}, {mib(best['peak_bytes'])} MiB) vs {p['recompute_pct']:.1f}% here"
    )
    pr = best.get("predicted_recompute_pct")
    if pr is not None:
        why += (
            f"; ckptc predicted {pr:.1f}% with its own cost model (which also counts pointwise FLOPs that "
            "FlopCounterMode ignores)"
        )
    return why


def analyse(result: dict[str, Any]) -> dict[str, Any]:
    points = [p for p in result.get("points", []) if _ok(p)]
    ck = [p for p in points if p["family"] in CKPTC_FAMILIES and p.get("matches_eager")]
    others = [p for p in points if p["family"] not in CKPTC_FAMILIES]
    not_dominated, on_every_op = [], []
    for p in others:
        if any(dominates(q, p) for q in ck):
            continue
        # Counting every op favours ckptc's own cost model, so the step time must agree.
        by = [q for q in ck if dominates(q, p, EVERY_OP) and _no_slower(q, p)]
        if by:
            best = min(by, key=lambda q: q[EVERY_OP])
            on_every_op.append(
                f"**{p['label']}** ({mib(p['peak_bytes'])} MiB; {p['recompute_pct']:.1f}% recompute on "
                f"FlopCounterMode's formulas, {p[EVERY_OP]:.1f}% counting every op, step time "
                f"{pct(p.get('time_ratio'), 2)}x eager) is dominated counting every op: {best['label']} "
                f"({mib(best['peak_bytes'])} MiB) recomputes {best[EVERY_OP]:.1f}% counting every op "
                f"({best['recompute_pct']:.1f}% on FlopCounterMode's formulas), step time "
                f"{pct(best.get('time_ratio'), 2)}x"
            )
            continue
        not_dominated.append(
            {
                "label": p["label"],
                "peak_bytes": p["peak_bytes"],
                "recompute_pct": p["recompute_pct"],
                "matches_eager": p.get("matches_eager"),
                "why": explain(p, ck),
            }
        )
    wrong = [p["label"] for p in points if not p.get("matches_eager")]
    over = [p["label"] for p in points if p.get("within_budget") is False]
    offline_mismatch = [
        p["label"]
        for p in points
        if p.get("offline_predicted_peak_bytes") is not None
        and p.get("predicted_peak_bytes") is not None
        and not p.get("same_plan_as")
        and abs(p["predicted_peak_bytes"] - p["offline_predicted_peak_bytes"])
        > max(64 * 1024, p["predicted_peak_bytes"] // 1000)
    ]
    failures = [
        (p["label"], p["status"], p.get("error") or p.get("reason"))
        for p in result.get("points", [])
        if p["status"] not in ("ok", "infeasible")
    ]
    infeasible = [p["label"] for p in result.get("points", []) if p["status"] == "infeasible"]
    # ckptc's own solvers: is auto ever beaten by another ckptc solver at its budget?
    auto_beaten = []
    for a in [p for p in ck if p.get("solver") == "auto"]:
        for q in ck:
            if (
                q.get("solver") not in (None, "auto")
                and q.get("budget_bytes") == a.get("budget_bytes")
                and q["recompute_pct"] < a["recompute_pct"] - RECOMPUTE_TOL
                and q["peak_bytes"] <= a["budget_bytes"]
            ):
                auto_beaten.append(
                    f"{a['label']} ({a['recompute_pct']:.1f}%) vs {q['label']} ({q['recompute_pct']:.1f}%)"
                )
    valid_nd = [nd for nd in not_dominated if nd["matches_eager"]]
    return {
        "ckptc_points": len(ck),
        "other_points": len(others),
        "dominates": not valid_nd and bool(ck),
        "not_dominated_valid": len(valid_nd),
        "not_dominated_invalid": len(not_dominated) - len(valid_nd),
        "not_dominated": not_dominated,
        "dominated_on_every_op": on_every_op,
        "wrong_gradients": wrong,
        "over_budget": over,
        "failures": failures,
        "infeasible": infeasible,
        "auto_beaten": auto_beaten,
        "offline_mismatch": offline_mismatch,
    }


def summary_markdown(results: list[dict[str, Any]], headline: dict[str, Any] | None = None) -> str:
    lines = [
        "# ckptc benchmark summary",
        "",
        "ckptc's curve dominates an alternative's point when some ckptc point (any solver or strategy, "
        f"loss and gradients equal to eager) has a measured peak at most the point's (+{PEAK_TOL:.0%}) "
        f"and recompute at most its (+{RECOMPUTE_TOL} percentage points). "
        "Recompute is counted with torch.utils.flop_counter's formulas (pointwise ops and reductions count 0); "
        "a point not dominated on those is judged again counting every op's FLOPs (ckptc's cost model: "
        "the same formulas, every other op priced by the elements it reads and writes) where the run "
        "measured both sides that way and ckptc's step is no slower; "
        "peak with ckptc.meter (allocator events) from the same baseline for every alternative.",
        "",
    ]
    rock = next((r.get("rockmate") for r in results if r.get("rockmate")), None)
    lines += [
        "| model | size | eager peak MiB | ckptc lowest peak MiB (recompute %) | points ok / total "
        "| ckptc dominates the valid points? |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    analyses = {}
    for r in results:
        a = analyse(r)
        analyses[r["model"]] = a
        ok = [p for p in r.get("points", []) if _ok(p)]
        ck = [p for p in ok if p["family"] in CKPTC_FAMILIES and p.get("matches_eager")]
        low = min(ck, key=lambda p: p["peak_bytes"]) if ck else None
        low_s = f"{mib(low['peak_bytes'])} ({low['recompute_pct']:.1f}%)" if low else "-"
        invalid = (
            f"; {a['not_dominated_invalid']} point(s) with gradients != eager not dominated"
            if a["not_dominated_invalid"]
            else ""
        )
        verdict = (
            "model failed"
            if r.get("status") == "error" and not ck
            else (
                (
                    "yes"
                    + (f" ({len(a['dominated_on_every_op'])} counting every op)" if a["dominated_on_every_op"] else "")
                )
                if a["dominates"]
                else f"no ({a['not_dominated_valid']} valid point(s) not dominated)"
            )
            + invalid
            if ck
            else "no ckptc point ran"
        )
        lines.append(
            f"| {r['model']} | {r.get('size')} | {mib(r.get('eager', {}).get('peak_bytes'))} | {low_s} | "
            f"{len(ok)} / {len(r.get('points', []))} | {verdict} |"
        )
    for r in results:
        a = analyses[r["model"]]
        lines += ["", f"## {r['model']}", ""]
        if r.get("status") == "error":
            lines.append(f"* model failed: {r.get('error')}")
        if a["dominates"] and not a["not_dominated"]:
            counted = len(a["dominated_on_every_op"])
            also = f" ({counted} of them counting every op, below)" if counted else ""
            lines.append(f"* ckptc's curve dominates all {a['other_points']} points of the other alternatives{also}.")
        elif a["dominates"]:
            lines.append(
                "* ckptc's curve dominates every point of the other alternatives whose gradients equal eager's."
            )
        for line in a.get("dominated_on_every_op", []):
            lines.append(f"* {line}.")
        for nd in a["not_dominated"]:
            flag = "" if nd["matches_eager"] else " (its gradients differ from eager's)"
            lines.append(
                f"* not dominated: **{nd['label']}**{flag} ({mib(nd['peak_bytes'])} MiB, "
                f"{nd['recompute_pct']:.1f}% recompute): {nd['why']}."
            )
        if a["wrong_gradients"]:
            lines.append(f"* loss or gradients differ from eager: {', '.join(a['wrong_gradients'])}.")
        if a["over_budget"]:
            lines.append(f"* ckptc measured peak over its budget: {', '.join(a['over_budget'])}.")
        if a["offline_mismatch"]:
            mismatch = ", ".join(a["offline_mismatch"])
            lines.append(f"* the run's plan differs from the offline decision (dedupe may be off): {mismatch}.")
        if a["auto_beaten"]:
            lines.append(
                f"* ckptc auto beaten by another ckptc solver at the same budget: {'; '.join(a['auto_beaten'])}."
            )
        if a["infeasible"]:
            lines.append(f"* infeasible (InfeasibleBudgetError): {', '.join(a['infeasible'])}.")
        grouped: dict[tuple[str, str], list[str]] = {}
        for label, status, why in a["failures"]:
            grouped.setdefault((status, str(why)[:300]), []).append(label)
        for (status, why), labels in grouped.items():
            lines.append(f"* {status}: {', '.join(labels)}: {why}")
    if headline:
        lines += ["", headline_markdown(headline, level=2)]
    if rock:
        lines += [
            "",
            "## Rockmate",
            "",
            f"{rock.get('note')}",
            f"Run-time check: `import rockmate` -> {rock.get('import_error') or 'ok'}.",
        ]
    return "\n".join(lines) + "\n"


def headline_markdown(result: dict[str, Any], level: int = 1) -> str:
    h = "#" * level
    budget = result["budget_bytes"]
    lines = [
        f"{h} Headline: longest sequence under {budget / 2**30:g} GiB",
        "",
        "Doubling then bisection over sequence length; a length fits when the step's peak is at most the budget.",
        "",
    ]
    for method, note in result.get("method_notes", {}).items():
        lines.append(f"* {method}: {note}")
    lines += [
        "",
        "| model | no checkpointing | per-block checkpointing | ckptc "
        "| ckptc verified (measured peak MiB, within budget) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for name, entry in result.get("models", {}).items():
        cells = []
        for method in ("none", "per_block", "ckptc"):
            e = entry.get(method, {})
            lo, hi = e.get("longest_fitting"), e.get("shortest_failing")
            cell = f"{lo:,}" if lo else "none"
            if hi:
                cell += f" (fails at {hi:,})"
            complete = e.get("complete", True)
            if "grain" not in e and lo and hi:  # older files: resolved if the bracket is tight
                complete = complete or hi - lo <= 2048 or hi / lo <= 1.0625
            if not complete:
                cell += " [time limit]"
            cells.append(cell)
        v = entry.get("ckptc", {}).get("verified") or {}
        within = "yes" if v.get("within_budget") else "**no**"
        vcell = (
            (
                f"{mib(v.get('measured_peak_bytes'))} MiB, {within}, "
                f"recompute {v.get('recompute_pct_predicted', 0):.1f}% (predicted)"
            )
            if "measured_peak_bytes" in v
            else v.get("error", "-")
        )
        lines.append(f"| {name} | {' | '.join(cells)} | {vcell} |")
    breakdowns = []
    for name, entry in result.get("models", {}).items():
        e = entry.get("ckptc", {})
        at = next((t for t in e.get("trials", []) if t.get("seq_len") == e.get("longest_fitting")), {})
        b = at.get("floor_breakdown")
        if b:
            breakdowns.append(
                f"| {name} | {e['longest_fitting']:,} | {mib(b['floor_bytes'])} | {mib(b['resident_bytes'])} "
                f"| {mib(b['kept_bytes'])} | {mib(b['working_set_bytes'])} | {mib(b['margin_bytes'])} |"
            )
    if breakdowns:
        lines += [
            "",
            "ckptc's floor at its longest length, for the graph that sets it (MiB): resident (parameters, inputs, "
            "what the step holds outside the graph), activations kept for backward, the working set on top of "
            "them at the peak (recomputation, backward temporaries), planning margin.",
            "",
            "| model | length | floor | resident | kept | working set | margin |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
            *breakdowns,
        ]
    if "seconds" in result:
        lines += ["", f"Total time: {result['seconds'] / 60:.1f} min."]
    return "\n".join(lines) + "\n"


def load_results(out: Path) -> list[dict[str, Any]]:
    results = []
    for path in sorted(out.glob("*.json")):
        if path.name == "headline.json":
            continue
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "model" in data and "points" in data:
            results.append(data)
    return results


def write_summary(out: Path) -> None:
    results = load_results(out)
    headline_path = out / "headline.json"
    headline = json.loads(headline_path.read_text()) if headline_path.exists() else None
    (out / "SUMMARY.md").write_text(summary_markdown(results, headline))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.report")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    out = Path(args.out)
    for result in load_results(out):
        write_model(out, result)
    if (out / "headline.json").exists():
        (out / "headline.md").write_text(headline_markdown(json.loads((out / "headline.json").read_text())))
    write_summary(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
