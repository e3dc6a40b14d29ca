"""Visual packages (vision-tower outputs keyed by what produced them), their store, and the stage service."""

from retrieval.packages.ephemeral import EphemeralPackages
from retrieval.packages.package import Fingerprint, Preprocess, VisualPackage
from retrieval.packages.service import Made, ModelPackages, Preparation, TowerSlot, VisualPackages
from retrieval.packages.storage_form import StorageDtype
from retrieval.packages.store import PackageStore
from retrieval.packages.tower import Prepared, Purpose, Usage, VisionTower

__all__ = ["EphemeralPackages", "Fingerprint", "Made", "ModelPackages", "PackageStore", "Preparation", "Prepared",
           "Preprocess", "Purpose", "StorageDtype", "TowerSlot", "Usage", "VisionTower", "VisualPackage",
           "VisualPackages"]
