from llmpipe.celery_app import app
from llmpipe.errors import LlmpipeError
from workers.context import context


@app.task(name="llmpipe.tokenize")
def tokenize(body: dict) -> dict:
    """``POST /tokenize`` on the preprocess queue: the stage that tokenizes every prompt
    answers, so the ids are the ones a request would carry (api/vllm/router.py)."""
    try:
        body = dict(body)
        return context().model(body.pop("model", None)).input_processor.tokenize_view(**body)
    except LlmpipeError as exc:
        return {"error": {"type": exc.reason.value, "message": exc.message, "param": exc.param}}
    except Exception as exc:
        if not any(c.__name__ == "TemplateError" for c in type(exc).__mro__):
            raise
        # The chat template refused these messages (jinja2's raise_exception): the client's fault.
        return {"error": {"type": "invalid_request", "message": f"chat template: {exc}", "param": "messages"}}
