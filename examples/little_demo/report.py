"""The little demo's report (rank 0): the run's header, the summary table, ``summary.json`` and
``training.png``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from recsdk.data import backend_for


def print_header(args: argparse.Namespace, world_size: int, device: torch.device, model: Any) -> None:
    data = args.data if args.data != "random" else f"random data {'without' if args.no_history else 'with'} history"
    print(f"little demo: {world_size} rank(s) on {device.type} ({backend_for(device)}), {data}, ", end="")
    print(f"{args.steps} steps of {args.batch_size} samples per rank")
    groups: dict[str, list[str]] = {}
    for module in ("ebc", "ec"):
        for name, p in model.plan.plan.get(module, {}).items():
            ranks = p.ranks or []
            where = f"{p.sharding_type} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
            groups.setdefault(where, []).append(name)
    for where, names in groups.items():
        listed = ", ".join(names) if len(names) <= 6 else f"{len(names)} tables, {names[0]} .. {names[-1]}"
        print(f"plan: {where}: {listed}")
    sys.stdout.flush()


def report(
    args: argparse.Namespace,
    world_size: int,
    device: torch.device,
    history: dict[str, Any],
    losses: list[float],
    stats: dict[str, dict[str, Any]],
    wall_s: float,
) -> None:
    """Print the summary table and write ``summary.json`` and ``training.png`` into ``args.out``."""
    tail = losses[-min(len(losses), 20) :]
    summary = {
        "world_size": world_size,
        "device": device.type,
        "data": args.data,
        "history": args.data == "random" and not args.no_history,
        "id_policy": args.id_policy,
        "resumed_from": history["resumed_from"],
        "steps": args.steps,
        "batch_size_per_rank": args.batch_size,
        "samples_per_s": round(history["samples_per_s"], 1),
        "train_s": round(history["train_s"], 2),
        "wall_s": round(wall_s, 2),
        "final_train_loss": sum(tail) / len(tail),  # mean of the last 20 steps, over all ranks
        "eval_auc": history["evals"][-1][1],
        "best_possible_auc": history["best_auc"],
        "eval_history": [{"step": s, "auc": a} for s, a in history["evals"]],
        "host_thread": history["host_thread"],
        "host_staged_modules": history["host_staged"],
        "inline_modules": history["inline"],
        "tables": stats,
        "published": history["published"],
    }
    out = Path(args.out)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(losses, history["evals"], history["best_auc"], out / "training.png")

    lines = [
        ("steps", f"{args.steps}"),
        ("samples/s (all ranks)", f"{summary['samples_per_s']:,.0f}"),
        ("final train loss", f"{summary['final_train_loss']:.4f}"),
        ("eval AUC", f"{summary['eval_auc']:.4f}"),
    ]
    if history["best_auc"] is not None:
        lines.append(("best possible AUC", f"{history['best_auc']:.4f}"))
    lines.append(("wall time (s)", f"{wall_s:.1f}"))
    print()
    for label, value in lines:
        print(f"{label:<28}{value:>12}")
    print()
    row = "{:<12}{:<8}{:>22}{:>10}{:>11}{:>19}{:>10}"
    header = ("table", "module", "ids stored / capacity", "inserts", "evictions", "admission rejects", "hit rate")
    print(row.format(*header))
    for name, s in stats.items():
        stored = f"{s['size']:,} / {s['capacity']:,}"
        counts = [f"{s[key]:,}" for key in ("inserts", "evictions", "admission_rejects")]
        print(row.format(name, s["module"], stored, *counts, f"{s['hit_rate']:.3f}"))
    cached = {name: s for name, s in stats.items() if "cache_hit_rate" in s}
    if cached:
        row = "{:<12}{:>14}{:>16}{:>12}{:>12}{:>18}"
        print()
        print(row.format("table", "cache slots", "cache hit rate", "swap-ins", "swap-outs", "store rows used"))
        for name, s in cached.items():
            print(
                row.format(
                    name,
                    f"{s['cache_slots']:,}",
                    f"{s['cache_hit_rate']:.3f}",
                    f"{s['swap_ins']:,}",
                    f"{s['swap_outs']:,}",
                    f"{s['store_rows_used']:,}",
                )
            )
    if history["published"]:
        _print_published(history["published"], args.publish_dir)
    if history["host_staged"]:
        print(f"\nhost stage run ahead on the pipeline's host thread for: {', '.join(history['host_staged'])}")
    if history["inline"]:
        where = "" if history["host_thread"] else " (no host thread on a CPU device)"
        print(f"\npipelined on TorchRec's schedule, on the calling thread{where}: {', '.join(history['inline'])}")
    print(f"\nwrote {out / 'summary.json'} and {out / 'training.png'}", flush=True)


def _print_published(records: list[dict[str, Any]], root: str) -> None:
    """The versions written: how many, ids and bytes per delta, and the time publishing took."""
    deltas = [r for r in records if r["kind"] == "delta"]
    fulls = [r for r in records if r["kind"] == "full"]
    seconds = sum(r["seconds"] for r in records)
    print(f"\npublished {len(records)} versions to {root} ({len(fulls)} full, {len(deltas)} deltas) in {seconds:.2f} s")
    if fulls:
        print(f"  full:  {fulls[-1]['ids']:,} ids, {fulls[-1]['bytes'] / 1e6:.2f} MB (the latest)")
    if deltas:
        ids = sum(r["ids"] for r in deltas) / len(deltas)
        deleted = sum(r["deleted"] for r in deltas) / len(deltas)
        size = sum(r["bytes"] for r in deltas) / len(deltas)
        print(f"  delta: {ids:,.0f} ids and {deleted:,.0f} deletions, {size / 1e6:.2f} MB (mean per delta)")


def plot(losses: list[float], evals: list[tuple[int, float]], best_auc: float | None, path: Path) -> None:
    """Training loss (and its moving average) and eval AUC over the steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(1, len(losses) + 1))
    window = max(1, len(losses) // 20)
    smooth = [
        sum(losses[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(losses))
    ]
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(steps, losses, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    ax_loss.plot(steps, smooth, color="tab:blue", label=f"mean of {window} steps")
    ax_loss.set(xlabel="step", ylabel="train loss (BCE)", title="training loss")
    ax_loss.legend()
    ax_auc.plot([s for s, _ in evals], [a for _, a in evals], "o-", color="tab:orange")
    if best_auc is not None:
        ax_auc.axhline(best_auc, color="gray", linestyle="--", label="best possible")
        ax_auc.legend()
    ax_auc.set(xlabel="step", ylabel="AUC", title="held-out AUC", ylim=(min(0.5, *(a - 0.02 for _, a in evals)), 1.0))
    ax_auc.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
