"""Testing helpers: argument specs and the conformance suite."""
