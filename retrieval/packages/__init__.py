"""Visual packages (vision-tower outputs keyed by what produced them), their store, and the stage service."""

from rubricsearch.retrieval.packages.ephemeral import EphemeralPackages
from rubricsearch.retrieval.packages.package import Fingerprint, Preprocess, VisualPackage
from rubricsearch.retrieval.packages.service import Made, ModelPackages, Preparation, TowerSlot, VisualPackages
from rubricsearch.retrieval.packages.storage_form import StorageDtype
from rubricsearch.retrieval.packages.store import PackageStore
from rubricsearch.retrieval.packages.tower import Prepared, Purpose, Usage, VisionTower

__all__ = ["EphemeralPackages", "Fingerprint", "Made", "ModelPackages", "PackageStore", "Preparation", "Prepared",
           "Preprocess", "Purpose", "StorageDtype", "TowerSlot", "Usage", "VisionTower", "VisualPackage",
           "VisualPackages"]
