"""Wire formats (det_local/wire/, rpc): the budgeted decoder, session frames."""
