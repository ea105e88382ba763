"""What every pipeline's request handling shares, so that two apps can answer with it.

Each pipeline keeps its request handling in a ``*Handler`` class: its own ingress subclasses
it (and adds the HTTP routes), and the OpenAI app (``pipelines.openai_api``) builds the same
handler over the same deployments from the settings that ingress reports
(``Handler.attach(app, ingress.settings())``). A request is then checked, limited and
answered the same whichever URL it came in by.
"""

from typing import Any

from pydantic import BaseModel

from carpool.schemas import ModelCard


class PipelineHandler:
    """Base of the pipelines' handlers: their settings, the names they answer to, their card."""

    args: BaseModel
    created: int  # Unix time the pipeline's app started: OpenAI's `created` on its cards
    model_name: str  # what clients put in `model`

    def settings(self) -> dict[str, Any]:
        """What another app needs to answer as this one does (the handler's ``attach``)."""
        return {"args": self.args.model_dump(), "created": self.created}

    def served_names(self) -> list[str]:
        """Every value of ``model`` this pipeline answers to (routing by model)."""
        return [self.model_name]

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created)

    async def model_cards(self) -> list[Any]:
        """The cards ``GET /v1/models`` lists for this pipeline (generate has several)."""
        return [self.model_card()]
