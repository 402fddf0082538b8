"""The OpenAI Batch API's state: files on disk, file and batch records in Redis, the feeding
lease, the output writer and the window of lines in flight (the HTTP side is api/batches/)."""
