"""Pure data: table schemas (v1, v2), lineage, img_shapes math, `UserError`. No torch imports."""

from schemas.errors import UserError
from schemas.img_shapes import (
    PIXELS_PER_PATCH,
    ImgShape,
    img_shapes_from_pixels,
    img_shapes_from_v1,
    normalize_img_shapes,
)
from schemas.lineage import Lineage
from schemas.table import (
    CURRENT_SCHEMA_VERSION,
    KNOWN_SCHEMA_VERSIONS,
    SCHEMA_V1,
    SCHEMA_V2,
    TENSOR_DTYPES,
    FieldSpec,
    TableSchema,
)

__all__ = [
    "CURRENT_SCHEMA_VERSION", "KNOWN_SCHEMA_VERSIONS", "PIXELS_PER_PATCH", "SCHEMA_V1", "SCHEMA_V2", "TENSOR_DTYPES",
    "FieldSpec", "ImgShape", "Lineage", "TableSchema", "UserError",
    "img_shapes_from_pixels", "img_shapes_from_v1", "normalize_img_shapes",
]
