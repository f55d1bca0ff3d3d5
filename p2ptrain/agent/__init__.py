"""p2ptrain.agent"""
