"""Where reference images come from: uploads, zip archives, server folders and URL lists.

Every source lists its entries when opened (raising ``InvalidInput``/``Forbidden``/``PayloadTooLarge`` for
the source as a whole), then offers :class:`SourceItem` s whose ``load()`` fails for that item alone.
"""

from indexer.sources.archive import ZipSource
from indexer.sources.base import (
    IMAGE_EXTENSIONS,
    Skipped,
    Source,
    SourceItem,
    SourceLimits,
)
from indexer.sources.folder import FolderSource
from indexer.sources.netguard import NetGuard, classify_address, system_resolve
from indexer.sources.uploads import UploadSource
from indexer.sources.urls import UrlFetcher, UrlSource, validate_url

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
