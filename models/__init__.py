from models import quiet_imports as _quiet_imports  # noqa: F401  (drops two harmless import-time messages)
