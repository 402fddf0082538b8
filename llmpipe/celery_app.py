"""The Celery app. Importing it loads no task code, no torch and no vLLM: the API uses it
only to send tasks by name."""

from celery import Celery

app = Celery("llmpipe")
app.config_from_object("celeryconfig")
