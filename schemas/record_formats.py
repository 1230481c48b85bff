"""The sealed records a written folder is checked against, and the newest format of each this release reads
(pure data: `store.checksum.check_recorded` checks a file against whichever sits beside it; train writes and
reads resume.json). Each record's format is its own: a bump of one never changes how the other is read."""

FOLDER_RECORD = "checksums.json"  # a final LoRA's, a table version's
FOLDER_RECORD_FORMAT = 1
ATTENTION_JSON = "attention.json"  # RUN/: the attention backend of the run's latest start and why (train)
RESUME_JSON = "resume.json"  # a checkpoint's (its `files` map covers lora/<file> too)
RESUME_FORMAT = 1
# resume.json `extra` key: the config fingerprints the run's earlier checkpoints recorded under an earlier spelling
# of its settings (a resume reads them as its own, stages/train/settings.py `known_fingerprint`), carried forward:
# evaluate's `same_training` takes their steps for this training's
EARLIER_FINGERPRINTS = "earlier_config_fingerprints"

# record name -> the newest format this release reads (above it: a newer release's record, schemas.newer)
FOLDER_RECORDS = {FOLDER_RECORD: FOLDER_RECORD_FORMAT, RESUME_JSON: RESUME_FORMAT}
