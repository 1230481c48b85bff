"""The `resize-bucket` stage: a source (folder, webdataset tars, JSONL) -> the `images` table.

`stage.run` is the entry; `sources` reads the source formats, `features.decode` decodes and sanitises images,
`bucketing` picks each image's bucket size.
"""
