"""MQTT sessions: the state a persistent session keeps, the registry that opens, resumes and expires them, topic filters."""
