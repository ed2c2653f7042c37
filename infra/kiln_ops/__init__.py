"""Everything operators and developers run that is not a Lambda: the `kiln` CLI, the local
stack, the embedded AWS, the mock model server, and what reads `template.yaml`."""

__all__: list[str] = []
