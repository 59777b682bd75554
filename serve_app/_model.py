"""Shared pydantic base: unknown keys are errors, never silently ignored."""

from pydantic import BaseModel, ConfigDict, ValidationError


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def __setattr__(self, name, value):
        # pydantic (2.14) stores an assigned value before the model's after-validators run and keeps it
        # when they refuse it: put the model back as it was, so a refused change leaves nothing applied
        before, fields_set = dict(self.__dict__), set(self.__pydantic_fields_set__)
        try:
            super().__setattr__(name, value)
        except ValidationError:
            object.__setattr__(self, "__dict__", before)
            object.__setattr__(self, "__pydantic_fields_set__", fields_set)
            raise
