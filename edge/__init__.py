"""omni-edge, the edge coordinator: the front door for every client request."""
