"""OpenAI's Files and Batches API on the durable queue (docs/api.md, "Files and batches")."""
