from llmpipe.celery_app import app
from llmpipe.messages import Generation
from workers.context import context


@app.task(name="llmpipe.postprocess")
def postprocess(msg: dict) -> dict:
    gen = Generation.model_validate(msg)
    return context().output_processor.process(gen).model_dump(mode="json")
