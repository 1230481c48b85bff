"""The `evaluate` stage: held-out loss and sample images, base vs LoRA -> a report folder.

`stage.run` is the entry; `report` renders metrics.json, grid.png and index.html.
"""
