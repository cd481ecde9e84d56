"""The app's configuration, shared by the launcher and the app: environment variables (the app is a
Streamlit script, so the launcher cannot pass arguments to a function)."""

ENV_DIR = "INSTRUMENTED_ALLOC_DASHBOARD_DIR"  # the directory whose recordings may be opened (default: cwd)
# The recordings selected first (shown side by side), relative to the directory, one name a line.
ENV_RECORDING = "INSTRUMENTED_ALLOC_DASHBOARD_RECORDING"
ENV_REFRESH = "INSTRUMENTED_ALLOC_DASHBOARD_REFRESH"  # seconds between live refreshes (default 2)
