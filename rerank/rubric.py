"""Scoring a shortlist against a rubric: one judgement per criterion, and an overall score formed from them.

The overall score of a rubric with criteria is the geometric mean of the per-criterion scores, so the ranking
and the per-criterion breakdown beside it always agree (a reference that clearly fails one criterion cannot
rank above one that meets them all). On the demo truth (``bench/quality.py``, docs/rubrics.md) the share of
criteria met by the top 5 of two-criterion rubrics leads or ties with it in every training run measured, and a
single clearly failed criterion cannot be averaged away in it. Only a search without criteria (a candidate image
alone, or one free-text line) is one judgement of the whole query.

Negation is built in, never left to the model: a criterion written as an absence ("no X", "without X",
"not X", …) is judged as the positive statement "X" and scored 1 − P(X).

Whether a query is reranked at all is the model's measured policy (:class:`RerankPolicy`): a checkpoint may carry
``rubricsearch-policy.json``, the nDCG@10 of the recall and the reranked order per query kind on held-out data
(the demo trainer writes it). For a kind whose reranking lost, :meth:`RubricReranker.score` keeps the recall
order itself (the reranker does not run) and scores each hit with its calibrated match probability; search only
reports the decision. A checkpoint without the file (Qwen3-VL-Reranker) reranks every kind, the official
behaviour. A judgement is always the reranker's raw P(yes): what it means for a team's criteria is the set's
calibration, fitted on the set's judgments (:mod:`rerank.calibration`, ``app/calibration.py``), whatever the
checkpoint.

The reranker's instruction templates are documented in README.md next to the recall templates
(``retrieval/search/instructions.py``) they pair with.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rubricsearch.rerank.protocol import Pair, Reranker
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.search.protocol import Judged, ScoringInstructions, ShortlistScores
from rubricsearch.retrieval.search.provenance import Calibration, NdcgPair, PolicyReport

RERANK_CANDIDATE_ONLY = "Judge whether the Document image shows the same subject as the Query image"
RERANK_TEXT_ONLY = "Judge whether the Document image shows: {criteria}"
CRITERION_WITH_CANDIDATE = "Judge whether the Document image matches the Query image on this criterion: {criterion}"
CRITERION_TEXT_ONLY = "Judge whether the Document image satisfies this criterion: {criterion}"
POLICY_FILE = "rubricsearch-policy.json"
AGGREGATE = "geometric mean of the per-criterion scores"
FLOOR = 1e-6  # a zero criterion score still ranks references that meet the other criteria better

QueryKind = Literal["criteria", "negative", "candidate", "candidate+criteria"]
QUERY_KINDS: tuple[QueryKind, ...] = ("criteria", "negative", "candidate", "candidate+criteria")

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
class KindPolicy:
    """Whether the scorer reranks searches of one kind, and the measurement that decided it.

    A scorer whose model was not measured reranks every kind (``measured`` is None). Where reranking lost to the
    recall order on the model's held-out measurement, the scorer keeps the recall order, and ``calibration``
    (slope, intercept; measured with it) maps the vector score to the probability of a match,
    ``sigmoid(slope · s + intercept)``, so ``score`` and the match threshold keep their meaning."""

    kind: QueryKind
    rerank: bool = True
    measured: dict[str, float] | None = None  # nDCG@10 of the recall and the reranked order
    calibration: tuple[float, float] | None = None
    source: str | None = None

    def recall_score(self, vector_score: float) -> float:
        """The score of a hit ordered by recall: its calibrated match probability (monotone in the vector score)."""
        if self.calibration is None:
            return vector_score
        slope, intercept = self.calibration
        return _sigmoid(slope * vector_score + intercept)

    def report(self) -> PolicyReport:
        return PolicyReport(kind=self.kind, rerank=self.rerank,
                            measured_ndcg10=None if self.measured is None else NdcgPair(**self.measured),
                            calibration=_pair(self.calibration), source=self.source)


def logit(p: float) -> float:
    """``log(p / (1 − p))`` of a probability clipped to [1e-7, 1 − 1e-7]: a judgement's P(yes) of exactly 0 or 1
    (float rounding of a confident model) stays finite, so the calibration fitted on it and applied to it agree."""
    q = min(max(p, 1e-7), 1 - 1e-7)
    return math.log(q / (1 - q))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _pair(calibration: tuple[float, float] | None) -> Calibration | None:
    return None if calibration is None else Calibration(slope=calibration[0], intercept=calibration[1])


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
                kinds[kind] = KindPolicy(kind, rerank, {"recall": recall, "reranked": reranked}, calibration, source)
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

    def __init__(self, reranker: Reranker, policy: RerankPolicy | None = None, *, version: str = "base",
                 base: Reranker | None = None) -> None:
        """``version``/``base``: a version trained from ``base`` for a set, named by its id and the base's model."""
        self.reranker = reranker
        self.model_id = (base or reranker).model_id
        self.revision = (base or reranker).revision
        self.version = version
        self.rerank_policy = policy or RerankPolicy()

    @property
    def packages(self) -> ModelPackages:
        return self.reranker.packages

    def instructions(self, rubric: Rubric, has_candidate: bool) -> ScoringInstructions:
        return rubric_instructions(rubric, has_candidate)

    def kind_policy(self, rubric: Rubric, has_candidate: bool) -> KindPolicy:
        return self.rerank_policy.for_kind(query_kind(rubric, has_candidate))

    def policy_report(self, rubric: Rubric, has_candidate: bool) -> PolicyReport:
        return self.kind_policy(rubric, has_candidate).report()

    def score(self, query: Content, rubric: Rubric, documents: Sequence[Content], recall_scores: Sequence[float],
              *, usage: Usage | None = None) -> ShortlistScores:
        policy = self.kind_policy(rubric, bool(query.images))
        if not policy.rerank:
            return _recall_order(policy, recall_scores)
        instr = self.instructions(rubric, bool(query.images))
        k = len(documents)
        if instr.overall is not None:  # no criteria: one judgement of the whole query
            whole = Content(texts=[instr.judged[0].statement] if instr.judged else [], images=list(query.images))
            scores = self.reranker.score_pairs([Pair(whole, doc, instr.overall) for doc in documents], usage=usage)
            negated = bool(instr.judged) and instr.judged[0].negated
            return ShortlistScores(overall=[1.0 - s if negated else s for s in scores], per_criterion=[[]] * k)
        pairs: list[Pair] = []
        for j, instruction in zip(instr.judged, instr.per_criterion, strict=True):
            crit_query = Content(texts=[j.statement], images=list(query.images))
            pairs += [Pair(crit_query, doc, instruction) for doc in documents]
        scores = self.reranker.score_pairs(pairs, usage=usage)
        per = [[1.0 - scores[k * c + d] if j.negated else scores[k * c + d] for c, j in enumerate(instr.judged)]
               for d in range(k)]
        return ShortlistScores(overall=[aggregate(p) for p in per], per_criterion=per)


def _recall_order(policy: KindPolicy, recall_scores: Sequence[float]) -> ShortlistScores:
    """A kind whose reranking lost on the measurement: the recall order stays (the reranker does not run), and
    each vector score becomes its calibrated match probability, so ``score`` keeps its meaning."""
    assert policy.measured is not None and policy.calibration is not None  # RerankPolicy.from_json checks both
    slope, intercept = policy.calibration
    return ShortlistScores(
        overall=[policy.recall_score(s) for s in recall_scores], per_criterion=[[] for _ in recall_scores],
        kept_recall_order=(f"stepped aside: for {policy.kind} searches this reranker lost to the recall order on "
                           f"its held-out measurement (nDCG@10 {policy.measured['reranked']:.3f} reranked, "
                           f"{policy.measured['recall']:.3f} recall order)"),
        formed=(f"the match probability of the vector score s, sigmoid({slope:.3f} · s + {intercept:.3f}), "
                f"calibrated with the reranker's measurement of {policy.kind} searches"))
