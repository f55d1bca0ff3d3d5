"""p2ptrain.planning"""
