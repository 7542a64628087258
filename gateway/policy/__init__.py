"""The policy document: model (pydantic), loader (YAML with positions), compiled form, holder."""
