"""``rubricsearch train SET --out DIR [--model reranker|embedder] [--activate]``: fine-tune a serving model on a
set's judgments in this data dir and write the result as a new model version (a checkpoint folder with
``card.json``), printing progress and the card; ``--activate`` re-embeds the set with a new embedder version from
its packages."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.cli.sets import cli_settings

if TYPE_CHECKING:
    from rubricsearch.app.model_loading import ModelKind
    from rubricsearch.retrieval.tuning.loop import Progress

KINDS: dict[str, ModelKind] = {"reranker": "reranker", "embedder": "embedding"}  # the flag's word -> the model kind


def register(sub: Any) -> None:
    from rubricsearch.retrieval.tuning.settings import TuningSettings

    d = TuningSettings()
    p = sub.add_parser("train", help="fine-tune the reranker or the embedder on a set's judgments (LoRA on the "
                                     "language model, from cached packages) into a new model version")
    p.add_argument("set", help="the set's id or name")
    p.add_argument("--out", type=Path, required=True, help="the new version's folder (must not exist)")
    p.add_argument("--model", choices=sorted(KINDS), default="reranker", help="which model to fine-tune "
                                                                             "(default reranker)")
    p.add_argument("--base", default=None, help="the checkpoint to start from (default: the one of that kind that "
                                                "serves this data dir)")
    p.add_argument("--activate", action="store_true", help="embedder only: then re-embed the set's references "
                                                           "with the version, from their packages")
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    p.add_argument("--alpha", type=int, default=d.alpha, help=f"LoRA alpha (default {d.alpha})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr:g})")
    p.add_argument("--steps", type=int, default=d.steps, help=f"at most this many steps (default {d.steps}; "
                                                              "early stopping may end sooner)")
    p.add_argument("--batch", type=int, default=d.batch, help=f"judged cells (reranker) or matching pairs "
                                                              f"(embedder) per step (default {d.batch})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of the split, order and adapters (default {d.seed})")
    p.add_argument("--json", action="store_true", help="print the whole card as JSON (with the judgment ids)")
    p.set_defaults(func=run)


def _printer(progress: Progress) -> None:
    if progress.validation is None and progress.step % 10 and progress.step != progress.steps:
        return
    validated = "" if progress.validation is None else f", validation {progress.metric} {progress.validation:.4f}"
    print(f"step {progress.step}/{progress.steps}: loss {progress.loss:.4f}{validated}", file=sys.stderr, flush=True)


def _summary(card: dict[str, Any], out: Path) -> str:
    data, metrics, training = card["data"], card["metrics"], card["training"]
    rows = [f"{card['kind']} version {out} (from {card['base_model']})",
            f"judgments {data['judgments']} (ids up to {data['max_judgment_id']}; "
            f"{data['skipped_without_package']} without a package skipped); references {data['train_references']} "
            f"train, {data['validation_references']} held out",
            f"steps {training['steps_run']} (best {training['best_step']}) on {training['device']} "
            f"{training['dtype']}, {card['wall_s']:.1f} s, vision encodes {card['vision_encodes']}"]
    if card["kind"] == "embedder":
        rows.append("held out      recall@10  nDCG@10  InfoNCE")
        rows += [f"  {side:<10} {metrics[side]['recall@10']:>9.4f}  {metrics[side]['ndcg@10']:>7.4f}  "
                 f"{metrics[side]['infonce']:>7.4f}" for side in ("before", "after")]
    else:
        rows.append("held out      AUC     log-loss  precision@0.5")
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
    from rubricsearch.app.training import reembed_set, train_set
    from rubricsearch.retrieval.errors import InvalidInput
    from rubricsearch.retrieval.tuning.settings import TuningSettings

    if args.activate and args.model != "embedder":
        raise InvalidInput("--activate re-embeds a set with an embedder version: give --model embedder")
    tuning = TuningSettings(rank=args.rank, alpha=args.alpha, lr=args.lr, steps=args.steps, batch=args.batch,
                            seed=args.seed)
    tuning.check()
    state = open_state(cli_settings())
    try:
        record = find_set(state, args.set)
        card = train_set(state, record, args.out, tuning, kind=KINDS[args.model], model=args.base, progress=_printer)
        print(json.dumps(card, indent=2, sort_keys=True) if args.json else _summary(card, args.out))
        if args.activate:
            report = reembed_set(state, record, args.out)
            print(f"re-embedded {report.references} references of {args.set} with {args.out} from their packages in "
                  f"{report.wall_s:.1f} s, vision encodes {report.vision_encodes}; queries must be embedded by the "
                  f"same version: serve it with RUBRICSEARCH_MODELS__EMBEDDING_MODEL={args.out}", file=sys.stderr)
    finally:
        state.close()
    return 0
