"""Federation between real daemons, one per Linux network namespace (root; marker `netns`)."""
