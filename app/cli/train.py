"""``rubricsearch train SET --out DIR [--model reranker|embedder] [--activate]``: fine-tune a serving model on a
set's judgments in this data dir and write the result as a new model version of the set (a checkpoint folder with
``card.json``, registered in the catalog as a training job's version is), printing progress and the card;
``--activate`` then activates it as the API does (:func:`app.model_versions.activate_version`: the same guard,
and for an embedder the same re-embedding from packages, switched with the activation)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.cli.sets import cli_settings

if TYPE_CHECKING:
    from rubricsearch.app.model_loading import ModelKind
    from rubricsearch.retrieval.tuning.loop import Progress

KINDS: dict[str, ModelKind] = {"reranker": "reranker", "embedder": "embedding"}  # the flag's word -> the model kind


def register(sub: Any) -> None:
    from rubricsearch.retrieval.tuning.settings import DEFAULTS

    d, e = DEFAULTS["reranker"], DEFAULTS["embedder"]
    p = sub.add_parser("train", help="fine-tune the reranker or the embedder on a set's judgments (LoRA on the "
                                     "language model, from cached packages) into a new model version")
    p.add_argument("set", help="the set's id or name")
    p.add_argument("--out", type=Path, required=True, help="the new version's folder (must not exist)")
    p.add_argument("--model", choices=sorted(KINDS), default="reranker", help="which model to fine-tune "
                                                                             "(default reranker)")
    p.add_argument("--base", default=None, help="the checkpoint to start from (default: the one of that kind that "
                                                "serves this data dir)")
    p.add_argument("--activate", action="store_true", help="then make the version the set's active one if it "
                                                           "beats the active model on held-out judgments (an "
                                                           "embedder's: re-embedding the set from its packages)")
    p.add_argument("--rank", type=int, default=d.rank, help=f"LoRA rank (default {d.rank})")
    p.add_argument("--alpha", type=int, default=d.alpha, help=f"LoRA alpha (default {d.alpha})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"learning rate (default {d.lr:g})")
    p.add_argument("--steps", type=int, default=None, help=f"at most this many steps (default: the reranker's "
                                                           f"{d.steps}, the embedder's {e.steps}; early stopping "
                                                           "may end sooner)")
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


def _comparison(table: dict[str, Any]) -> str:
    """The guard's side-by-side table, as the API returns it in ``comparison``."""
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.4f}"

    rows = [f"{table['active']} (active) against {table['candidate']} (candidate) on "
            f"{table['held_out_judgments']} held-out judgments, vision encodes {table['vision_encodes']}",
            f"  {'metric':<24} {'better':<7} {'active':>8} {'candidate':>10}  candidate is"]
    rows += [f"  {r['metric']:<24} {r['better_when']:<7} {number(r['active']):>8} {number(r['candidate']):>10}  "
             f"{r['candidate_is']}" for r in table["metrics"]]
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from rubricsearch.app.sets import find_set
    from rubricsearch.app.state import open_state
    from rubricsearch.app.training import train_set
    from rubricsearch.indexer.catalog.sets import new_id
    from rubricsearch.indexer.catalog.versions import add_version
    from rubricsearch.retrieval.tuning.settings import asked

    tuning = asked(args.model, steps=args.steps, rank=args.rank, alpha=args.alpha, lr=args.lr, batch=args.batch,
                   seed=args.seed)
    tuning.check()
    state = open_state(cli_settings())  # training loads its base checkpoint itself: no serving model here
    try:
        record = find_set(state, args.set)
        card = train_set(state, record, args.out, tuning, kind=KINDS[args.model], model=args.base, progress=_printer)
        try:
            with state.catalog.write() as session:
                version = add_version(session, record.id, args.model, str(args.out.resolve()), card,
                                      version_id=new_id())
        except BaseException:
            shutil.rmtree(args.out, ignore_errors=True)  # registered nowhere (the set went, or the catalog failed)
            raise
        print(json.dumps(card, indent=2, sort_keys=True) if args.json else _summary(card, args.out))
        print(f"version {version.id} of set {record.name}", file=sys.stderr)
    finally:
        state.close()
    if args.activate:
        _activate(args.model, record.id, version.id)
    return 0


def _activate(model: str, set_id: str, version_id: str) -> None:
    """The API's activation, in a state with the models it compares and serves (a reranker's guard scores through
    search, which embeds)."""
    from rubricsearch.app.model_versions import activate_version
    from rubricsearch.app.sets import find_set
    from rubricsearch.app.state import open_state
    from rubricsearch.retrieval.errors import Conflict

    state = open_state(cli_settings(), embedder=True, reranker=model == "reranker")
    try:
        try:
            table = activate_version(state, find_set(state, set_id), version_id)
        except Conflict as exc:
            if "comparison" in exc.details:
                print(_comparison(exc.details["comparison"]), file=sys.stderr)
            raise
        print(_comparison(table))
        print(f"activated: {version_id} is the set's {model}" + (
            " (its references re-embedded with it from their packages)" if model == "embedder" else
            "; the set's calibration was fitted on another reranker's scores: searches give no verdicts from it "
            "until it is refitted (a server with workers refits it, or POST /v1/sets/{set}/calibration)"))
    finally:
        state.close()
