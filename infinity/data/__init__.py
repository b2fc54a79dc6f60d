"""The job's data: text corpora as tokens, fine-tuning records, their formats, masking, packing, the token
cache and the batches of every rank."""
