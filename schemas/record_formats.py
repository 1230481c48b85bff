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
# resume.json `extra` key: the attention backend a resume took the run's checkpoints written before resume.json held
# `attention_backend` for (stages/train/settings.py `recorded_backend`: the resume was allowed only where their
# backend is this one), carried forward by every later start. The one rule for such a record (evaluate's
# `same_training`, schemas/up_to_date.py `known_backend`): its backend is the one a record of its run names here;
# with none, it is unknown, and one training only with a record whose backend is unknown too (never any backend's:
# a run trained afresh with another backend and the same config fingerprint is another training)
UNRECORDED_BACKEND = "unrecorded_attention_backend"

# record name -> the newest format this release reads (above it: a newer release's record, schemas.newer)
FOLDER_RECORDS = {FOLDER_RECORD: FOLDER_RECORD_FORMAT, RESUME_JSON: RESUME_FORMAT}
