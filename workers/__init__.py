"""Per-queue worker processes: what each kind runs and the objects each process owns."""
