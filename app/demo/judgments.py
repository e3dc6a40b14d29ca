"""The demo set's judgments and calibration, made the way any team's set gets them.

Each face's true attributes are its metadata (``species``, ``fur``, ``ears``, ``stripes``, ``eyes``: a manifest a
team would upload), every attribute is derived into judgments through the product's own derivation
(:func:`indexer.catalog.judgment_rules.derive`: "yes" for the face's value's statement, "no" for the others), worded
as the Compare page's candidates are titled ("a cat", "ginger fur", "triangular ears", "dark forehead stripes", "no
forehead stripes", "green eyes", …), and the set's calibration is fitted by the product's refit
(:func:`app.calibration.refit`). Nothing demo-specific reaches search: its verdicts come from that calibration.

Every step is idempotent: metadata merged with the same values, judgments re-recorded as they are (a no-op), and a
refit only when the set has no calibration for the serving reranker or its judgments changed since the last one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion, demo_faces, demo_images
from rubricsearch.retrieval.images import sha256_hex

AUTHOR = "rubricsearch demo: the generated faces' true attributes"


def statements(attribute: str, held: set[str]) -> dict[str, str]:
    """The statement of each value the set's faces hold, as the candidates' titles and the README's criteria word
    it."""
    return {value: Criterion(attribute, value).text for value in VALUES[attribute] if value in held}


def demo_metadata(count: int) -> dict[str, dict[str, str]]:
    """Each demo face's true attributes, by the sha256 of the bytes the demo ingests."""
    return {sha256_hex(data): {a: face.value(a) for a in ATTRIBUTES}
            for face, (_, data) in zip(demo_faces(count), demo_images(count), strict=True)}


@dataclass(frozen=True)
class Prepared:
    judgments: int  # the set's judgments after the derivation
    recorded: int  # of them, written by this call (0 on a restart)
    refitted: bool
    calibration_version: int | None
    status: str | None


def ensure_judgments(state: Any, set_id: str, count: int) -> Prepared:
    """Label the demo faces, derive their judgments and fit the set's calibration if it is missing or stale."""
    from rubricsearch.app.calibration import current, needs_refit, refit
    from rubricsearch.indexer.catalog import find_images, get_set, list_judgments
    from rubricsearch.indexer.catalog.judgment_rules import derive, record_derivation
    from rubricsearch.indexer.jobs.metadata import change_metadata

    truth = demo_metadata(count)
    with state.catalog.read() as session:
        present = find_images(session, set_id, list(truth))
    change_metadata(state.catalog, state.index, set_id, {sha: truth[sha] for sha in present})
    with state.catalog.write() as session:
        before = {j.id for j in list_judgments(session, set_id)}
        for attribute in ATTRIBUTES:
            wording = statements(attribute, {truth[sha][attribute] for sha in present})
            record_derivation(session, set_id, derive(session, set_id, attribute, statements=wording, author=AUTHOR))
        after = {j.id for j in list_judgments(session, set_id)}
        record = get_set(session, set_id)
    if not needs_refit(state.catalog, state.search, set_id):
        found = current(state.catalog, set_id)
        assert found is not None  # a judged set needs a refit until it has a fit
        return Prepared(len(after), len(after - before), False, found[0].version, found[0].status)
    fitted = refit(state.catalog, state.search, record).calibration
    return Prepared(len(after), len(after - before), True, fitted.version, fitted.status)
