"""The demo engine: scenarios that drive an instrumented reference allocator."""
