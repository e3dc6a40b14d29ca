"""``rubricsearch train SET --out DIR``: fine-tune the reranker on a set's judgments in this data dir and write the
result as a new model version (a checkpoint folder with ``card.json``), printing progress and the card."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.cli.sets import cli_settings

if TYPE_CHECKING:
    from rubricsearch.rerank.tuning import Progress


def register(sub: Any) -> None:
    from rubricsearch.rerank.tuning.settings import TuningSettings

    d = TuningSettings()
    p = sub.add_parser("train", help="fine-tune the reranker on a set's judgments (LoRA on the language model, from "
                                     "cached packages) into a new model version")
    p.add_argument("set", help="the set's id or name")
    p.add_argument("--out", type=Path, required=True, help="the new version's folder (must not exist)")
    p.add_argument("--model", default=None, help="the reranker checkpoint to start from (default: the one that "
                                                 "serves this data dir)")
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    p.add_argument("--alpha", type=int, default=d.alpha, help=f"LoRA alpha (default {d.alpha})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr:g})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"at most this many steps (default {d.steps}; "
                                                              "early stopping may end sooner)")
    p.add_argument("--batch", type=int, default=d.batch, help=f"judged cells per step (default {d.batch})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the split, order and adapters (default {d.seed})")
    p.add_argument("--json", action="store_true", help="print the whole card as JSON (with the judgment ids)")
    p.set_defaults(func=run)


def _printer(progress: Progress) -> None:
    if progress.validation_log_loss is None and progress.step % 10 and progress.step != progress.steps:
        return
    validated = ("" if progress.validation_log_loss is None
                 else f", validation log-loss {progress.validation_log_loss:.4f}")
    print(f"step {progress.step}/{progress.steps}: loss {progress.loss:.4f}{validated}", file=sys.stderr, flush=True)


def _summary(card: dict[str, Any], out: Path) -> str:
    data, metrics, training = card["data"], card["metrics"], card["training"]
    rows = [f"version {out} (from {card['base_model']})",
            f"judgments {data['judgments']} (ids up to {data['max_judgment_id']}; "
            f"{data['skipped_without_package']} without a package skipped); references {data['train_references']} "
            f"train, {data['validation_references']} held out",
            f"steps {training['steps_run']} (best {training['best_step']}) on {training['device']} "
            f"{training['dtype']}, {card['wall_s']:.1f} s, vision encodes {card['vision_encodes']}",
            "held out      AUC     log-loss  precision@0.5"]
    for side in ("before", "after"):
        m = metrics[side]
        auc = "-" if m["auc"] is None else f"{m['auc']:.4f}"
        precision = "-" if m["precision_at_0.5"] is None else f"{m['precision_at_0.5']:.4f}"
        rows.append(f"  {side:<10} {auc:>7}  {m['log_loss']:>8.4f}  {precision:>13}")
    rows.append(f"card: {out / 'card.json'}")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from rubricsearch.app.sets import find_set
    from rubricsearch.app.state import open_state
    from rubricsearch.app.training import train_set
    from rubricsearch.rerank.tuning.settings import TuningSettings

    tuning = TuningSettings(rank=args.rank, alpha=args.alpha, lr=args.lr, steps=args.steps, batch=args.batch,
                            seed=args.seed)
    tuning.check()
    state = open_state(cli_settings())
    try:
        card = train_set(state, find_set(state, args.set), args.out, tuning, model=args.model, progress=_printer)
    finally:
        state.close()
    print(json.dumps(card, indent=2, sort_keys=True) if args.json else _summary(card, args.out))
    return 0
