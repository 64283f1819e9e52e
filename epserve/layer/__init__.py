"""The public layer: the service a rank drives (dispatch, expert FFN, combine) and its CUDA-graph capture."""
