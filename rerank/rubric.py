"""Scoring a shortlist against a rubric: one judgement per criterion, and an overall score formed from them.

The overall score of a rubric with criteria is the geometric mean of the per-criterion scores, so the ranking
and the per-criterion breakdown beside it always agree (a reference that clearly fails one criterion cannot
rank above one that meets them all). On the demo truth (``bench/quality.py``, docs/rubrics.md) the share of
criteria met by the top 5 of two-criterion rubrics leads or ties with it in every training run measured (0.869,
as the mean and minimum, against 0.594 in recall order; a less-trained reranker: 0.694, mean 0.663), and a single
clearly failed criterion cannot be averaged away in it. Only a search without criteria (a candidate image alone, or one
free-text line) is one judgement of the whole query.

Negation is built in, never left to the model: a criterion written as an absence ("no X", "without X",
"not X", …) is judged as the positive statement "X" and scored 1 − P(X).

Whether a query is reranked at all is the model's measured policy (:class:`RerankPolicy`): a checkpoint may carry
``rubricsearch-policy.json``, the nDCG@10 of the recall and the reranked order per query kind on held-out data
(the demo trainer writes it). A kind whose reranking lost keeps the recall order, its score calibrated to a match
probability; a checkpoint without the file (Qwen3-VL-Reranker) reranks every kind, the official behaviour. The
file may also calibrate a kind's judgements (Platt scaling of each P(yes) on its logit, so that 0.5 means "as
likely as not" and a statement no reference meets stays under it); without it a judgement is the raw P(yes).

The reranker's instruction templates are documented in README.md next to the recall templates
(``retrieval/search/instructions.py``) they pair with.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rubricsearch.rerank.protocol import Pair, Reranker
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.search.protocol import (
    QUERY_KINDS,
    Judged,
    KindPolicy,
    QueryKind,
    ScoringInstructions,
    ShortlistScores,
)

RERANK_CANDIDATE_ONLY = "Judge whether the Document image shows the same subject as the Query image"
RERANK_TEXT_ONLY = "Judge whether the Document image shows: {criteria}"
CRITERION_WITH_CANDIDATE = "Judge whether the Document image matches the Query image on this criterion: {criterion}"
CRITERION_TEXT_ONLY = "Judge whether the Document image satisfies this criterion: {criterion}"
POLICY_FILE = "rubricsearch-policy.json"
AGGREGATE = "geometric mean of the per-criterion scores"
FLOOR = 1e-6  # a zero criterion score still ranks references that meet the other criteria better

# The forms users write an absence in; what follows is the positive statement the model judges.
_NEGATION = re.compile(
    r"^(?:(?:no|not|without|never|lacks?|lacking|free of|absence of|isn'?t|is not|aren'?t|are not|"
    r"(?:does|do)(?: not|n'?t) (?:have|show)|(?:has|have|with) no)\s+(?:any\s+)?|non-)(?P<statement>\S.*)$",
    re.IGNORECASE)


def judged(criterion: str) -> Judged:
    """The statement the reranker judges for ``criterion``, and whether its score is then 1 − P(statement)."""
    text = criterion.strip()
    match = _NEGATION.match(text)
    if match is None:
        return Judged(criterion, text, False)
    return Judged(criterion, match.group("statement").strip(), True)


def aggregate(scores: Sequence[float]) -> float:
    """The overall score of one reference: the geometric mean of its per-criterion scores."""
    return math.exp(sum(math.log(max(s, FLOOR)) for s in scores) / len(scores))


def query_kind(rubric: Rubric, has_candidate: bool) -> QueryKind:
    """The kind a search is measured and decided as: a candidate alone, a candidate with criteria, criteria
    with an absence among them ("no X"), or criteria only (one free-text line counts as one criterion)."""
    if has_candidate:
        return "candidate" if rubric.empty else "candidate+criteria"
    statements = rubric.criteria or (rubric.text,)
    return "negative" if any(judged(c).negated for c in statements) else "criteria"


@dataclass(frozen=True)
class RerankPolicy:
    """Per query kind, whether reranking is used: decided by the nDCG@10 measured with the checkpoint (reranked
    at least as good as recall order: rerank), every kind reranked where nothing was measured."""

    kinds: Mapping[QueryKind, KindPolicy] = field(default_factory=dict)

    def for_kind(self, kind: QueryKind) -> KindPolicy:
        return self.kinds.get(kind) or KindPolicy(kind)

    @classmethod
    def from_json(cls, data: Any, source: str) -> RerankPolicy:
        """The policy file's ``kinds``; a kind that steps aside must carry the calibration of its recall score."""
        kinds: dict[QueryKind, KindPolicy] = {}
        try:
            for kind in QUERY_KINDS:
                row = data["kinds"].get(kind)
                if row is None:
                    continue
                recall, reranked = float(row["recall_ndcg10"]), float(row["reranked_ndcg10"])
                calibration = _calibration(row.get("recall_calibration"))
                rerank = reranked >= recall
                if not rerank and calibration is None:
                    raise InvalidInput(f"{source}: {kind!r} steps aside from reranking without a recall calibration")
                kinds[kind] = KindPolicy(kind, rerank, {"recall": recall, "reranked": reranked}, calibration, source,
                                         _calibration(row.get("judgement_calibration")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InvalidInput(f"{source} is not a valid rerank policy: {exc!r}") from exc
        return cls(kinds)


def _calibration(row: Any) -> tuple[float, float] | None:
    """A policy file's ``{"slope": a, "intercept": b}`` (absent: none)."""
    return None if row is None else (float(row["slope"]), float(row["intercept"]))


def read_policy(checkpoint: str | Path) -> RerankPolicy:
    """The policy recorded with a reranker checkpoint (a local directory or a hub id in the cache), or the
    official behaviour (rerank every kind) when it has none."""
    path = Path(checkpoint).expanduser() / POLICY_FILE
    if not path.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            found = try_to_load_from_cache(str(checkpoint), POLICY_FILE)
        except Exception:  # not a repo id: a checkpoint without a policy
            found = None
        if not isinstance(found, str):
            return RerankPolicy()
        path = Path(found)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"cannot read the rerank policy {path}: {exc}") from exc
    return RerankPolicy.from_json(data, str(path))


def rubric_instructions(rubric: Rubric, has_candidate: bool) -> ScoringInstructions:
    if rubric.criteria:
        judgements = tuple(judged(c) for c in rubric.criteria)
        template = CRITERION_WITH_CANDIDATE if has_candidate else CRITERION_TEXT_ONLY
        return ScoringInstructions(None, tuple(template.format(criterion=j.statement) for j in judgements),
                                   judgements, AGGREGATE)
    if has_candidate and rubric.empty:
        return ScoringInstructions(RERANK_CANDIDATE_ONLY, (), (), "the reranker's judgement of the whole query")
    # one free-text line (with or without a candidate) is one criterion: negation applies to it too
    whole = judged(rubric.text)
    template = CRITERION_WITH_CANDIDATE if has_candidate else RERANK_TEXT_ONLY
    return ScoringInstructions(template.format(criterion=whole.statement, criteria=whole.statement), (), (whole,),
                               "1 − the reranker's judgement of the positive statement" if whole.negated
                               else "the reranker's judgement of the whole query")


class RubricReranker:
    """A :class:`~retrieval.search.protocol.ShortlistScorer` over any :class:`Reranker`.

    Each criterion's query is the candidate (if any) with that criterion's positive statement; all C x K
    pairs go in one ``score_pairs``, and the overall score is their aggregate (no separate joint pass).
    """

    def __init__(self, reranker: Reranker, policy: RerankPolicy | None = None) -> None:
        self.reranker = reranker
        self.model_id = reranker.model_id
        self.revision = reranker.revision
        self.rerank_policy = policy or RerankPolicy()

    @property
    def packages(self) -> ModelPackages:
        return self.reranker.packages

    def instructions(self, rubric: Rubric, has_candidate: bool) -> ScoringInstructions:
        instr = rubric_instructions(rubric, has_candidate)
        cal = self.policy(rubric, has_candidate).judgement_calibration
        if cal is None:
            return instr
        return replace(instr, formed=f"{instr.formed}; each judgement's P(yes) calibrated to the probability that "
                                     f"its statement holds, sigmoid({cal[0]:.3f} · logit(P) + {cal[1]:.3f}), "
                                     "as measured with the reranker")

    def policy(self, rubric: Rubric, has_candidate: bool) -> KindPolicy:
        return self.rerank_policy.for_kind(query_kind(rubric, has_candidate))

    def score(self, query: Content, rubric: Rubric, documents: Sequence[Content], *,
              usage: Usage | None = None) -> ShortlistScores:
        instr = self.instructions(rubric, bool(query.images))
        calibrated = self.policy(rubric, bool(query.images)).judgement
        k = len(documents)
        if instr.overall is not None:  # no criteria: one judgement of the whole query
            whole = Content(texts=[instr.judged[0].statement] if instr.judged else [], images=list(query.images))
            scores = [calibrated(s) for s in
                      self.reranker.score_pairs([Pair(whole, doc, instr.overall) for doc in documents], usage=usage)]
            negated = bool(instr.judged) and instr.judged[0].negated
            return ShortlistScores(overall=[1.0 - s if negated else s for s in scores], per_criterion=[[]] * k)
        pairs: list[Pair] = []
        for j, instruction in zip(instr.judged, instr.per_criterion, strict=True):
            crit_query = Content(texts=[j.statement], images=list(query.images))
            pairs += [Pair(crit_query, doc, instruction) for doc in documents]
        scores = [calibrated(s) for s in self.reranker.score_pairs(pairs, usage=usage)]
        per = [[1.0 - scores[k * c + d] if j.negated else scores[k * c + d] for c, j in enumerate(instr.judged)]
               for d in range(k)]
        return ShortlistScores(overall=[aggregate(p) for p in per], per_criterion=per)
