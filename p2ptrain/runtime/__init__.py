"""p2ptrain.runtime"""
