"""The layers below as the proxy reaches them: in process (`LocalBackend`) or in the core process over the core link (`RemoteBackend`)."""
