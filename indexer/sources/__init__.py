"""Where reference images come from: uploads, zip archives, server folders and URL lists.

Every source lists its entries when opened (raising ``InvalidInput``/``Forbidden``/``PayloadTooLarge`` for
the source as a whole), then offers :class:`SourceItem` s whose ``load()`` fails for that item alone.
"""

from rubricsearch.indexer.sources.archive import ZipSource
from rubricsearch.indexer.sources.base import (
    IMAGE_EXTENSIONS,
    Skipped,
    Source,
    SourceItem,
    SourceLimits,
)
from rubricsearch.indexer.sources.folder import FolderSource
from rubricsearch.indexer.sources.netguard import NetGuard, classify_address, system_resolve
from rubricsearch.indexer.sources.uploads import UploadSource
from rubricsearch.indexer.sources.urls import UrlFetcher, UrlSource, validate_url

__all__ = [
    "IMAGE_EXTENSIONS",
    "FolderSource",
    "NetGuard",
    "Skipped",
    "Source",
    "SourceItem",
    "SourceLimits",
    "UploadSource",
    "UrlFetcher",
    "UrlSource",
    "ZipSource",
    "classify_address",
    "system_resolve",
    "validate_url",
]
