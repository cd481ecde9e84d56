"""The app's configuration, shared by the launcher and the app: environment variables (the app is a
Streamlit script, so the launcher cannot pass arguments to a function)."""

ENV_DIR = "INSTRUMENTED_ALLOC_DASHBOARD_DIR"  # the directory whose recordings may be opened (default: cwd)
ENV_RECORDING = "INSTRUMENTED_ALLOC_DASHBOARD_RECORDING"  # the recording selected first, relative to the directory
ENV_REFRESH = "INSTRUMENTED_ALLOC_DASHBOARD_REFRESH"  # seconds between live refreshes (default 2)
