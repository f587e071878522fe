"""Short tables of every benchmark result file in a folder (the end of gpu_session.sh's output).

    python bench/summary.py OUT_DIR [--max-chars 9000]

The full tables, every run's fields and the logs stay in the JSON files and logs.tar.gz.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl  # noqa: E402


def errors(d: dict, limit: int = 220) -> list[str]:
    """One line per run that failed: its status and the end of its error."""
    out = []
    for name, r in d.get("runs", {}).items():
        status = str(r.get("status", ""))
        if status.startswith(("ok", "skipped")) or not (r.get("error") or status):
            continue
        err = " ".join(str(r.get("error", "")).split())
        out.append(f"  {name}: {status[:40]}: {err[-limit:]}")
    return (["failed runs:"] + out) if out else []


def vs_trl(d: dict) -> list[str]:
    rows = []
    for name, r in d["runs"].items():
        trl = d["runs"].get(f"{r.get('group')}/trl") or {}
        mine = r.get("side") in ("edgerl", "unsloth")   # TRL's other runs (another allocator, fp16) are not ratios
        ratio = bl.times(r, trl, "tokens_per_s") if mine else "-"
        mem = bl.times(r, trl, "measured_gib") if mine else "-"
        est = (f"{r['estimate_gib']:.1f} ({bl.fmt(r.get('estimate_error'), '{:+.0%}')})"
               if r.get("estimate_gib") is not None else "-")
        rows.append([name, str(r.get("status", "-"))[:28], bl.fmt(r.get("median_step_s")),
                     bl.fmt(r.get("tokens_per_s"), "{:.0f}"), ratio, bl.fmt(r.get("peak_allocated_gib"), "{:.1f}"),
                     bl.fmt(r.get("measured_gib"), "{:.1f}"), mem, bl.fmt(r.get("memory_gib"), "{:g}"), est])
    out = [bl.table(["run", "status", "s/step", "tok/s", "vs TRL", "alloc GiB", "device GiB", "vs TRL",
                     "budget", "estimate (err)"], rows)]
    out.append("speeds are this GPU's (p40/t4 rows: that card's memory, not its speed); device = peak reserved + "
               "outside the allocator")
    bad = d.get("check_failures") or []
    out.append("checks: " + ("all passed" if not bad else f"{len(bad)} FAILED: " + "; ".join(bad)[:1200]))
    return out


def memory(d: dict) -> list[str]:
    rows = []
    for name, r in d["runs"].items():
        rows.append([name, str(r.get("status", "-"))[:28], bl.fmt(r.get("estimate_gib")),
                     r.get("estimate_peak_phase", "-"), bl.fmt(r.get("peak_reserved_gib")),
                     bl.fmt(r.get("outside_allocator_gib")), bl.fmt(r.get("measured_gib")),
                     bl.fmt(r.get("estimate_error"), "{:+.1%}")])
    return [bl.table(["run", "status", "estimate", "phase", "reserved", "outside", "measured", "error"], rows),
            d.get("summary", "")]


def multi(d: dict) -> list[str]:
    return [d.get("table", "(no table: the run was cut short; see the runs in the JSON)")]


def agents(d: dict) -> list[str]:
    ratio = d.get("trl_ratio")
    return [str(d.get("table") or ""), str(d.get("trl_table") or ""),
            f"TRL's rollout time / edgerl's static engine's: {ratio:.2f}x" if ratio else ""]


def generic(d: dict) -> list[str]:
    return [str(d.get("table") or d.get("summary") or "")[:1500]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("--max-chars", type=int, default=9000)
    args = ap.parse_args()
    parts = []
    for f in sorted(Path(args.out_dir).glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except ValueError:
            parts.append(f"## {f.name}: not valid JSON")
            continue
        if not isinstance(d, dict) or "runs" not in d:
            if f.name == "measure.json" and isinstance(d, dict):
                parts.append(f"## {f.name}\n" + json.dumps({k: d[k] for k in list(d)[:12]}, default=str)[:1200])
            continue
        script = (d.get("meta") or {}).get("script", "")
        fn = {"bench_vs_trl": vs_trl, "bench_memory": memory, "bench_multi": multi, "bench_agents": agents}.get(script,
                                                                                                           generic)
        parts.append(f"## {f.name} ({script}, {(d.get('meta') or {}).get('device', '')})\n"
                     + "\n".join(fn(d) + errors(d)))
    text = "\n\n".join(parts)
    if len(text) > args.max_chars:
        text = text[:args.max_chars] + "\n... (cut; the JSON files hold everything)"
    files = [p.name for p in Path(args.out_dir).iterdir()]
    print(text)
    if len(files) > 8:
        print(f"\nWARNING: {len(files)} files in {args.out_dir}; only 8 come back: {sorted(files)}")


if __name__ == "__main__":
    main()
