"""Before/after cost comparisons of two ``llmpipe bench`` runs, and llmpipe's own CPU per request in one process."""
