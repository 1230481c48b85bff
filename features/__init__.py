"""The stage side of the store: which stage writes which table, the order the stages fill them, and how train /
evaluate open their features (`text` + `vae`, checked against the model and the split). `store/` knows tables,
not stages; what it would need to know about stages lives here (tests/test_import_rules.py checks it)."""
