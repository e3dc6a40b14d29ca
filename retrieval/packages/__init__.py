"""Visual packages (vision-tower outputs keyed by what produced them) and their store."""

from retrieval.packages.package import Fingerprint, VisualPackage
from retrieval.packages.store import PackageStore, StorageDtype

__all__ = ["Fingerprint", "PackageStore", "StorageDtype", "VisualPackage"]
