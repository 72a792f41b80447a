"""The PDD router: path choice (P->MD, P->RLD->MD, outlier filter) and the OpenAI-compatible front."""
